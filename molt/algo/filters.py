"""Group filters applied before training: complete groups only, and DAPO dynamic filtering.

Design notes and decisions: docs/internals.md, section `molt/algo/filters.py`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from molt.types import Trajectory

REASONS = ("incomplete", "all_equal", "out_of_range")


@dataclass(slots=True)
class FilterResult:
    kept: dict[str, list[Trajectory]]  # group_id -> its trajectories, in input order
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))  # reason -> groups
    metrics: dict[str, float] = field(default_factory=dict)


def _drop_reason(
    group: Sequence[Trajectory],
    group_size: int,
    drop_all_equal: bool,
    score_range: tuple[float, float] | None,
) -> str | None:
    ok = [t for t in group if t.ok]
    if len({t.rollout_id for t in ok}) < group_size:
        return "incomplete"
    scores = [float(t.effective_score) for t in ok]
    if drop_all_equal and max(scores) - min(scores) <= 1e-9:  # equal but for float rounding
        return "all_equal"
    if score_range is not None and not score_range[0] <= sum(scores) / len(scores) <= score_range[1]:
        return "out_of_range"
    return None


def filter_groups(
    groups: Mapping[str, Sequence[Trajectory]],
    group_size: int,
    *,
    drop_all_equal: bool = True,
    score_range: tuple[float, float] | None = None,
) -> FilterResult:
    """Keep complete, informative groups.

    groups: group_id -> the trajectories gathered for it; group_size: rollouts per prompt
    (`--rollout.n_samples_per_prompt`); score_range: (low, high) for the group mean
    (`--algo.dynamic_filtering_range`), None = no range test.
    Returns FilterResult(kept, dropped counts by reason, metrics "filter/kept_groups",
    "filter/dropped/<reason>", "filter/kept_frac"). Kept groups contain only their ok trajectories."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1 (got {group_size})")
    if score_range is not None and not score_range[0] <= score_range[1]:
        raise ValueError(f"score_range must be (low, high) with low <= high (got {score_range})")
    result = FilterResult(kept={})
    for gid, group in groups.items():
        reason = _drop_reason(group, group_size, drop_all_equal, score_range)
        if reason is None:
            result.kept[gid] = [t for t in group if t.ok]
        else:
            result.dropped[reason] += 1
    result.metrics = {
        "filter/kept_groups": float(len(result.kept)),
        **{f"filter/dropped/{r}": float(n) for r, n in result.dropped.items()},
        "filter/kept_frac": len(result.kept) / len(groups) if groups else 1.0,
    }
    return result
