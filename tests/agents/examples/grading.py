"""A helper module next to the agent files: they import it by plain name, as researchers do."""


def grade(text, label):
    return 1.0 if text is not None and str(label) in text else 0.0
