"""Advantage estimators: hand-computed small cases, segments of one rollout, degenerate groups."""

import math

import pytest
import torch

from molt.algo import (
    ESTIMATORS,
    AdvantageBatch,
    AdvantageParams,
    AdvantageResult,
    compute_advantages,
    register_estimator,
    rollout_stats,
    to_tokens,
)
from molt.types import Experience, Segment, Trajectory, import_file

T = torch.tensor


def three_segment_batch() -> AdvantageBatch:
    """Group 0: rollout 7 (reward 1) split into three segments, rollouts 8 and 9 (reward 0), one segment each.
    Group 1: rollouts 20 (reward 2) and 21 (reward 4)."""
    mask = T(
        [
            [0, 1, 1, 0],  # rollout 7, segment 0
            [0, 0, 1, 1],  # rollout 7, segment 1
            [0, 1, 0, 0],  # rollout 7, segment 2
            [1, 1, 0, 0],  # rollout 8
            [0, 1, 1, 1],  # rollout 9
            [1, 0, 0, 0],  # rollout 20
            [0, 1, 1, 0],  # rollout 21
        ]
    )
    return AdvantageBatch(
        rewards=T([1.0, 1.0, 1.0, 0.0, 0.0, 2.0, 4.0]),
        group_ids=T([0, 0, 0, 0, 0, 1, 1]),
        rollout_ids=T([7, 7, 7, 8, 9, 20, 21]),
        action_mask=mask,
    )


def per_row_value(adv: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """The single value every action token of a row carries (asserting it is single)."""
    out = []
    for a, m in zip(adv, mask.bool()):
        vals = a[m]
        assert torch.allclose(vals, vals[:1].expand_as(vals)), "advantage must be constant along the row"
        assert (a[~m] == 0).all(), "advantage must be 0 off action tokens"
        out.append(float(vals[0]))
    return out


# group 0 counts rollout 7 once: rewards [1, 0, 0] -> mean 1/3, unbiased std sqrt(1/3).
# (Counting its three segments would give mean 3/5.) Group 1: rewards [2, 4] -> mean 3, std sqrt(2).
S0, S1 = math.sqrt(1 / 3), math.sqrt(2)
EXPECTED = {
    "grpo": [(2 / 3) / (S0 + 1e-6)] * 3 + [(-1 / 3) / (S0 + 1e-6)] * 2 + [-1 / (S1 + 1e-6), 1 / (S1 + 1e-6)],
    "dr_grpo": [2 / 3] * 3 + [-1 / 3] * 2 + [-1.0, 1.0],
    # leave-one-out: 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5; 2 - 4 = -2; 4 - 2 = 2
    "rloo": [1.0] * 3 + [-0.5] * 2 + [-2.0, 2.0],
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_group_estimators_by_hand_with_three_segments(name):
    batch = three_segment_batch()
    result = compute_advantages(name, batch)
    assert per_row_value(result.advantages, batch.action_mask) == pytest.approx(EXPECTED[name], rel=1e-5)
    assert result.returns is None


def test_rollout_stats_count_each_rollout_once():
    s = rollout_stats(three_segment_batch())
    assert s.reward.tolist() == [1.0, 0.0, 0.0, 2.0, 4.0]
    assert s.group_size.tolist() == [3, 3, 3, 2, 2]
    assert s.group_mean.tolist() == pytest.approx([1 / 3] * 3 + [3.0] * 2)
    assert s.row_rollout.tolist() == [0, 0, 0, 1, 2, 3, 4]


def test_reinforce_discounts_across_segments_in_segment_order():
    # rollout A: actions a0 a1 in segment 0, a context token then a2 in segment 1; reward 1. Rollout B: one
    # action, reward 0. gamma 0.5 -> returns A: [0.25, 0.5, 1], B: [0]. Rows come in reverse segment order.
    batch = AdvantageBatch(
        rewards=T([1.0, 1.0, 0.0]),
        group_ids=T([0, 0, 1]),
        rollout_ids=T([0, 0, 1]),
        action_mask=T([[0, 1], [1, 1], [1, 0]]),
        segment_index=T([1, 0, 0]),
    )
    out = compute_advantages("reinforce", batch, AdvantageParams(gamma=0.5))
    assert out.returns.tolist() == [[0.0, 1.0], [0.25, 0.5], [0.0, 0.0]]
    # whitening over the 4 action tokens [0.25, 0.5, 1, 0]: mean 0.4375, population var 0.13671875
    z = lambda x: (x - 0.4375) / math.sqrt(0.13671875 + 1e-8)
    expected = [[0.0, z(1.0)], [z(0.25), z(0.5)], [z(0.0), 0.0]]
    assert out.advantages.tolist() == [pytest.approx(r, abs=1e-6) for r in expected]


def test_reinforce_kl_as_token_reward():
    # one rollout, 3 actions, gamma 1, reward 1, kl [1, 2, 0.5] * 0.1 -> token rewards [-0.1, -0.2, 0.95]
    batch = AdvantageBatch(
        rewards=T([1.0]),
        group_ids=T([0]),
        rollout_ids=T([0]),
        action_mask=T([[1, 1, 1, 0]]),
        kl=T([[1.0, 2.0, 0.5, 99.0]]),
    )
    out = compute_advantages("reinforce", batch, AdvantageParams(kl_coef=0.1, whiten=False))
    assert out.advantages[0].tolist() == pytest.approx([0.65, 0.75, 0.95, 0.0])
    with pytest.raises(ValueError, match="kl"):
        batch.kl = None
        compute_advantages("reinforce", batch, AdvantageParams(kl_coef=0.1))


def test_reinforce_baseline_subtracts_group_mean_then_whitens():
    batch = AdvantageBatch(
        rewards=T([1.0, 0.0, 3.0]),
        group_ids=T([0, 0, 1]),
        rollout_ids=T([0, 1, 2]),
        action_mask=T([[1, 1], [1, 0], [1, 1]]),
    )
    raw = compute_advantages("reinforce_baseline", batch, AdvantageParams(whiten=False))
    # group 0 mean 0.5 -> +0.5 / -0.5; rollout 2 is a group of one -> 0
    assert raw.advantages.tolist() == [[0.5, 0.5], [-0.5, 0.0], [0.0, 0.0]]
    white = compute_advantages("reinforce_baseline", batch).advantages
    # 5 action tokens [0.5, 0.5, -0.5, 0, 0]: mean 0.1, var (0.16 + 0.16 + 0.36 + 0.01 + 0.01) / 5 = 0.14
    z = lambda x: (x - 0.1) / math.sqrt(0.14 + 1e-8)
    assert white.tolist() == [
        pytest.approx(r, abs=1e-6) for r in [[z(0.5), z(0.5)], [z(-0.5), 0.0], [z(0), z(0)]]
    ]


def test_gae_by_hand_skips_context_tokens():
    # one rollout: a0 a1 | context | a2 (second segment). values 0.5, 0.2, 0.8 on actions, garbage elsewhere.
    # gamma 0.9, lam 0.5: d2 = 1 - 0.8 = 0.2; d1 = 0.9 * 0.8 - 0.2 = 0.52; d0 = 0.9 * 0.2 - 0.5 = -0.32
    # A2 = 0.2; A1 = 0.52 + 0.45 * 0.2 = 0.61; A0 = -0.32 + 0.45 * 0.61 = -0.0455; returns = A + V
    batch = AdvantageBatch(
        rewards=T([1.0, 1.0]),
        group_ids=T([0, 0]),
        rollout_ids=T([0, 0]),
        action_mask=T([[1, 1, 0], [0, 1, 0]]),
        values=T([[0.5, 0.2, 100.0], [-7.0, 0.8, float("nan")]]),
    )
    out = compute_advantages("gae", batch, AdvantageParams(gamma=0.9, lam=0.5, whiten=False))
    assert out.advantages.tolist() == [pytest.approx(r, abs=1e-6) for r in [[-0.0455, 0.61, 0], [0, 0.2, 0]]]
    assert out.returns.tolist() == [pytest.approx(r, abs=1e-6) for r in [[0.4545, 0.81, 0], [0, 1.0, 0]]]
    # gamma = lam = 1: A = R - V
    plain = compute_advantages("gae", batch, AdvantageParams(whiten=False)).advantages
    assert plain.tolist() == [pytest.approx(r, abs=1e-6) for r in [[0.5, 0.8, 0], [0, 0.2, 0]]]
    with pytest.raises(ValueError, match="values"):
        batch.values = None
        compute_advantages("gae", batch)


# role_baseline's baseline is the controller's running mean, not the batch's (tests/runtime/test_roles.py)
@pytest.mark.parametrize("name", sorted(set(ESTIMATORS) - {"role_baseline"}))
def test_degenerate_cases_are_zero_never_nan(name):
    values = torch.full((4, 3), 0.3)
    # group of one (rollout 0), all-equal group (rollouts 1, 2), a rollout with an empty mask (3)
    batch = AdvantageBatch(
        rewards=T([5.0, 1.0, 1.0, 1.0]),
        group_ids=T([0, 1, 1, 1]),
        rollout_ids=T([0, 1, 2, 3]),
        action_mask=T([[1, 1, 0], [1, 0, 0], [0, 1, 1], [0, 0, 0]]),
        values=values,
    )
    adv = compute_advantages(name, batch).advantages
    assert torch.isfinite(adv).all()
    assert (adv[3] == 0).all()
    if name not in ("reinforce", "gae"):  # baseline estimators: no relative signal anywhere
        assert (adv == 0).all()
    empty = AdvantageBatch(
        rewards=T([1.0, 0.0]),
        group_ids=T([0, 0]),
        rollout_ids=T([0, 1]),
        action_mask=torch.zeros(2, 3),
        values=torch.zeros(2, 3),
    )
    assert (compute_advantages(name, empty).advantages == 0).all()


def test_user_mistakes_raise_value_error():
    batch = three_segment_batch()
    with pytest.raises(ValueError, match="unknown advantage estimator 'nope'.*grpo"):
        compute_advantages("nope", batch)
    with pytest.raises(ValueError, match="kl_coef"):
        compute_advantages("grpo", batch, AdvantageParams(kl_coef=0.1))
    with pytest.raises(ValueError, match="gamma"):
        compute_advantages("reinforce", batch, AdvantageParams(gamma=1.5))
    with pytest.raises(ValueError, match="rewards"):
        bad = three_segment_batch()
        bad.rewards[1] = 0.5
        compute_advantages("grpo", bad)
    with pytest.raises(ValueError, match="group_ids"):
        bad = three_segment_batch()
        bad.group_ids[1] = 1
        compute_advantages("grpo", bad)
    with pytest.raises(ValueError, match="segment_index"):
        bad = three_segment_batch()
        bad.segment_index = T([0, 0, 1, 0, 0, 0, 0])
        compute_advantages("reinforce", bad)
    with pytest.raises(ValueError, match="rewards"):
        AdvantageBatch(
            rewards=T([1.0]), group_ids=T([0, 0]), rollout_ids=T([0, 1]), action_mask=torch.ones(2, 2)
        )
    with pytest.raises(ValueError, match="already registered"):
        register_estimator("grpo", "group")(lambda b, p: None)
    with pytest.raises(ValueError, match="kind"):
        register_estimator("test_nowhere", "rank")


def test_a_new_estimator_registered_by_name():
    @register_estimator("test_max_baseline", "group")
    def max_baseline(batch, params):
        s = rollout_stats(batch)
        group_max = torch.zeros(int(s.group.max()) + 1, dtype=s.reward.dtype).scatter_reduce(
            0, s.group, s.reward, "amax", include_self=False
        )
        return AdvantageResult(to_tokens(s.reward - group_max[s.group], s, batch))

    try:
        batch = three_segment_batch()
        adv = compute_advantages("test_max_baseline", batch).advantages
        assert per_row_value(adv, batch.action_mask) == [0, 0, 0, -1, -1, -2, 0]
    finally:
        del ESTIMATORS["test_max_baseline"]


PLUGIN = """from molt.algo import register_estimator


@register_estimator("test_again", "group")
def again(batch, params):
    return None
"""


def test_a_plugin_loaded_again_registers_once_and_a_clash_is_still_refused(tmp_path):
    """The same function from the same file, imported again under another module name (a second load, an
    agent file that imports it too), registers once; another file's function under that name is refused."""
    plugin = tmp_path / "plugin.py"
    plugin.write_text(PLUGIN)
    try:
        first = import_file(plugin, "first").again
        import_file(plugin, "second")
        assert ESTIMATORS["test_again"] is first
        other = tmp_path / "other.py"
        other.write_text(PLUGIN)
        with pytest.raises(ValueError, match="'test_again' is already registered"):
            import_file(other, "third")
        assert ESTIMATORS["test_again"] is first
    finally:
        del ESTIMATORS["test_again"]


def test_from_experiences_keeps_segments_of_a_rollout_together():
    def traj(rid, reward, n_segments):
        segs = [
            Segment(
                token_ids=[1, 2, 3], action_mask=[0, 1, 1], behavior_logprobs=[0, -1, -1], versions=[-1, 0, 0]
            )
            for _ in range(n_segments)
        ]
        return Trajectory(rollout_id=rid, group_id="g", segments=segs, reward=reward)

    trajs = [traj("a", 1.0, 3), traj("b", 0.0, 1), traj("c", 0.0, 1)]
    exps = [Experience.from_segment(t, i) for t in trajs for i in range(len(t.segments))]
    batch = AdvantageBatch.from_experiences(exps)
    assert batch.rollout_ids.tolist() == [0, 0, 0, 1, 2] and batch.segment_index.tolist() == [0, 1, 2, 0, 0]
    adv = compute_advantages("dr_grpo", batch).advantages
    assert per_row_value(adv, batch.action_mask) == pytest.approx([2 / 3] * 3 + [-1 / 3] * 2)
    exps[0].action_mask = None
    with pytest.raises(ValueError, match="reload"):
        AdvantageBatch.from_experiences(exps)


def test_integer_rewards_give_float_advantages():
    batch = AdvantageBatch(
        rewards=T([1, 0]), group_ids=T([0, 0]), rollout_ids=T([0, 1]), action_mask=torch.ones(2, 1)
    )
    assert compute_advantages("dr_grpo", batch).advantages.tolist() == [[0.5], [-0.5]]


def test_on_policy_distill_is_the_teachers_log_ratio_per_token():
    # two segments of rollout 0 (reward 0.5) and rollout 1 (reward -1); kl = log pi - log pi_teacher per token:
    # A_t = -kl_coef * kl_t + reward_coef * reward, on action tokens only, no discount, no whitening
    batch = AdvantageBatch(
        rewards=T([0.5, 0.5, -1.0]),
        group_ids=T([0, 0, 0]),
        rollout_ids=T([0, 0, 1]),
        action_mask=T([[0, 1, 1], [0, 0, 1], [1, 1, 0]]),
        kl=T([[9.0, 0.4, -0.2], [9.0, 9.0, 1.0], [0.0, 2.0, 9.0]]),
    )
    out = compute_advantages("on_policy_distill", batch, AdvantageParams(kl_coef=2.0, reward_coef=0.1))
    assert out.advantages.flatten().tolist() == pytest.approx([0, -0.75, 0.45, 0, 0, -1.95, -0.1, -4.1, 0])
    pure = compute_advantages("on_policy_distill", batch, AdvantageParams(kl_coef=1.0))  # the reward ignored
    assert pure.advantages.flatten().tolist() == pytest.approx([0, -0.4, 0.2, 0, 0, -1.0, 0.0, -2.0, 0])
    batch.kl = None
    with pytest.raises(ValueError, match="kl"):
        compute_advantages("on_policy_distill", batch, AdvantageParams(kl_coef=1.0))
