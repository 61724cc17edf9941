"""Experiences: segment -> offloaded payload in Ray's object store -> reload; balanced rank assignment."""
import pytest

from molt.runtime.experience import assign_to_ranks, outcome_from_trajectory
from molt.types import Experience, RolloutStatus, Segment, Trajectory


def _traj():
    segs = [Segment([1, 2, 3, 4], [0, 0, 1, 1], [0.0, 0.0, -0.5, -0.25], [-1, -1, 3, 4]),
            Segment([1, 9, 8], [0, 1, 1], [0.0, -1.0, -2.0], [-1, 4, 4], break_reason="compaction")]
    return Trajectory("r1", "g1", segs, reward=1.5, info={"turns": 2})


def test_outcome_without_offload_keeps_payload_and_light_fields():
    out = outcome_from_trajectory(_traj(), offload=False)
    assert out.status is RolloutStatus.OK and out.reward == 1.5 and out.response_tokens == 4
    assert out.break_reasons == ["start", "compaction"]
    assert [e.min_version for e in out.experiences] == [3, 4] and out.min_version == 3
    assert out.experiences[1].token_ids == [1, 9, 8] and out.experiences[1].num_actions == 2


def test_failed_trajectory_has_no_experiences():
    traj = Trajectory("r", "g", [], status=RolloutStatus.TIMEOUT, error="too slow")
    out = outcome_from_trajectory(traj, offload=False)
    assert out.experiences == [] and out.error == "too slow"


def test_offload_and_reload_through_ray(ray_local):
    out = outcome_from_trajectory(_traj(), offload=True)
    exp = out.experiences[0]
    assert exp.offloaded and exp.token_ids is None and exp.behavior_logprobs is None
    assert exp.num_tokens == 4 and exp.reward == 1.5  # light fields stay
    exp.reload()
    assert exp.token_ids == [1, 2, 3, 4] and exp.behavior_logprobs == [0.0, 0.0, -0.5, -0.25]


def test_assignment_balances_tokens():
    exps = [Experience(f"r{i}", "g", 0, 0.0, n, 1, 0) for i, n in enumerate([100, 90, 50, 40, 30, 20, 10, 5])]
    ranks = assign_to_ranks(exps, 2)
    loads = [sum(e.num_tokens for e in r) for r in ranks]
    assert sorted(loads) == [170, 175] and sum(len(r) for r in ranks) == 8
    with pytest.raises(ValueError, match="cannot feed"):
        assign_to_ranks(exps[:1], 2)


def test_assignment_keeps_a_rollouts_segments_together():
    sizes = {"a": [60, 40], "b": [30], "c": [50, 20, 10], "d": [25]}
    exps = [Experience(r, "g", i, 0.0, n, 1, 0) for r, ns in sizes.items() for i, n in enumerate(ns)]
    ranks = assign_to_ranks(exps, 2)
    homes = {e.rollout_id: {i for i, rank in enumerate(ranks) if e in rank} for e in exps}
    assert all(len(h) == 1 for h in homes.values())
    # LPT over rollouts (100, 80, 30, 25): {a, d} = 125 and {c, b} = 110
    assert sorted(sum(e.num_tokens for e in r) for r in ranks) == [110, 125]
