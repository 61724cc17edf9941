"""Group filters: complete groups only, DAPO dynamic filtering, counts by first reason."""

import pytest

from molt.algo import filter_groups
from molt.types import RolloutStatus, Trajectory


def group(gid: str, rewards: list[float], failed: int = 0, scores: list | None = None) -> list[Trajectory]:
    trajs = [
        Trajectory(
            rollout_id=f"{gid}-{i}", group_id=gid, reward=r, score=None if scores is None else scores[i]
        )
        for i, r in enumerate(rewards)
    ]
    for t in trajs[:failed]:
        t.status = RolloutStatus.AGENT_ERROR
    return trajs


def test_filters_by_hand():
    groups = {
        "mixed": group("mixed", [1.0, 0.0, 0.0, 1.0]),  # mean 0.5: kept
        "all_one": group("all_one", [1.0] * 4),  # all equal
        "all_zero": group("all_zero", [0.0] * 4),  # all equal (and out of range: first reason counts)
        "high": group("high", [1.0, 1.0, 1.0, 0.0]),  # mean 0.75 > 0.7
        "short": group("short", [1.0, 0.0, 1.0]),  # 3 of 4 rollouts
        "failed": group("failed", [1.0, 0.0, 1.0, 0.0], failed=1),  # a failed rollout does not count
        "scored": group("scored", [1.0] * 4, scores=[0.2, 0.4, 0.3, 0.5]),  # scores, not rewards, are tested
    }
    out = filter_groups(groups, group_size=4, drop_all_equal=True, score_range=(0.3, 0.7))
    assert sorted(out.kept) == ["mixed", "scored"]
    assert out.dropped == {"incomplete": 2, "all_equal": 2, "out_of_range": 1}
    assert out.metrics["filter/kept_groups"] == 2.0 and out.metrics["filter/dropped/all_equal"] == 2.0
    assert out.metrics["filter/kept_frac"] == pytest.approx(2 / 7)


def test_dynamic_filtering_off_keeps_every_complete_group_without_failures():
    groups = {
        "same": group("same", [1.0, 1.0]),
        "extra": group("extra", [1.0, 0.0, 1.0], failed=1),
        "single": group("single", [0.0]),
    }
    out = filter_groups(groups, group_size=2, drop_all_equal=False)
    assert sorted(out.kept) == ["extra", "same"] and out.dropped["incomplete"] == 1
    assert [t.rollout_id for t in out.kept["extra"]] == ["extra-1", "extra-2"]  # only ok rollouts


def test_duplicate_rollouts_do_not_complete_a_group():
    dup = group("d", [1.0, 0.0])
    dup[1].rollout_id = dup[0].rollout_id
    assert filter_groups({"d": dup}, group_size=2).dropped["incomplete"] == 1


def test_user_mistakes_and_empty_input():
    assert filter_groups({}, group_size=2).metrics["filter/kept_frac"] == 1.0
    with pytest.raises(ValueError, match="group_size"):
        filter_groups({}, group_size=0)
    with pytest.raises(ValueError, match="score_range"):
        filter_groups({}, group_size=1, score_range=(1.0, 0.0))
