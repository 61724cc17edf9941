"""A helper next to the agent files, imported by plain name as the reference's examples do: the last number
of the text against the ground truth of a `reward_model` label ({"ground_truth": ..., "style": "rule"})."""

import re


def compute_score(text, label):
    truth = label["ground_truth"] if isinstance(label, dict) else label
    numbers = re.findall(r"-?\d+", text or "")
    return 1.0 if numbers and numbers[-1] == str(truth) else 0.0
