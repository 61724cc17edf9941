"""A helper module next to the agent files: they import it by plain name, as researchers do."""


def grade(text, label):
    truth = label["ground_truth"] if isinstance(label, dict) else label  # a `reward_model` column's label
    return 1.0 if text is not None and str(truth) in text else 0.0
