"""DAPO dynamic filtering: a group whose scores carry no learning signal is dropped before training.

Design notes and decisions: docs/internals.md, section `molt/algo/filters.py`.
"""

from __future__ import annotations

from collections.abc import Sequence


def dapo_drop(scores: Sequence[float], score_range: Sequence[float]) -> str | None:
    """Why DAPO drops a complete group whose rollouts scored `scores`, or None to keep it: "all_equal" (a group
    estimator would give it zero advantage), else "out_of_range" (the mean score lies outside the closed band
    `score_range`, `--algo.dynamic_filtering_range`)."""
    if max(scores) - min(scores) <= 1e-9:  # equal but for float rounding
        return "all_equal"
    low, high = score_range
    if not low <= sum(scores) / len(scores) <= high:
        return "out_of_range"
    return None
