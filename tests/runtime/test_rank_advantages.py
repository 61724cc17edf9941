"""Token-level estimators split over trainer ranks equal one computation over the whole window: group
baselines come from the controller, a rollout's segments stay on one rank, whitening is global."""
import asyncio
import random

import pytest
import torch

from molt.algo import AdvantageBatch, AdvantageParams, compute_advantages
from molt.runtime.experience import assign_to_ranks
from molt.runtime.trainer_group import TrainerGroup, terminal_rewards
from molt.types import Experience


def _window(seed: int = 0) -> list[Experience]:
    """4 groups x 3 rollouts, some with two segments (the second one's context tokens are mask 0)."""
    rng, exps = random.Random(seed), []
    for g in range(4):
        for r in range(3):
            reward = float(rng.choice([0.0, 1.0, 0.5]))
            for s in range(rng.choice([1, 2])):
                n = rng.randint(4, 9)
                mask = [0] * 2 + [1] * (n - 2)
                exps.append(Experience(f"g{g}r{r}", f"g{g}", s, reward, n, n - 2, 0, token_ids=[5] * n,
                                       action_mask=mask, behavior_logprobs=[0.0] * n, versions=[0] * n))
    return exps


@pytest.mark.parametrize("estimator", ["reinforce", "reinforce_baseline"])
def test_two_ranks_equal_one_window(tiny_llama_dir, ray_local, estimator):
    exps = _window()
    params = {"gamma": 0.9, "lam": 1.0}
    batch = AdvantageBatch.from_experiences(exps)
    expected = compute_advantages(estimator, batch, AdvantageParams(**params)).advantages
    rows = list({e.rollout_id: (e.rollout_id, e.group_id, e.reward) for e in exps}.values())
    rewards = terminal_rewards(estimator, rows)
    shares = assign_to_ranks(exps, 2)

    async def main():
        group = TrainerGroup(2, estimator=estimator, advantage_params=params)
        try:
            await group.setup({"model_name_or_path": str(tiny_llama_dir)})
            return await group.call("advantages", shares, [rewards, rewards])
        finally:
            for rank in group.ranks:
                ray_local.kill(rank)
    got = asyncio.run(main())
    index = {(e.rollout_id, e.segment_index): i for i, e in enumerate(exps)}
    for share, advs in zip(shares, got):
        assert share, "both ranks get work"
        for exp, adv in zip(share, advs):
            want = expected[index[(exp.rollout_id, exp.segment_index)], : exp.num_tokens]
            assert torch.allclose(torch.tensor(adv, dtype=want.dtype), want, atol=1e-5), exp.rollout_id


def test_kl_as_a_token_reward_by_hand(tiny_llama_dir, ray_local):
    """REINFORCE++ with the KL in the reward: r_t = -coef * (behavior_t - ref_t) on every action token, plus the
    rollout's reward on its last one; advantage_t = sum of r_s for s >= t (gamma 1, no whitening). The reference
    log-probs come from a plain full-logits forward of the checkpoint (`reference_logprobs`)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
    from trainer_helpers import reference_logprobs

    rng, coef = random.Random(3), 0.1
    exps = []
    for i in range(3):
        n = rng.randint(6, 10)
        ids, mask = [rng.randrange(10, 380) for _ in range(n)], [0, 0, 0] + [1] * (n - 3)
        blp = [rng.uniform(-6.0, -1.0) if m else 0.0 for m in mask]
        exps.append(Experience(f"r{i}", "g", 0, float(i), n, n - 3, 0, token_ids=ids, action_mask=mask,
                               behavior_logprobs=blp, versions=[0] * n))
    expected = []
    for e in exps:
        ref = reference_logprobs(tiny_llama_dir, e.token_ids, 1.0)
        r = [-coef * (b - q) if m else 0.0 for b, q, m in zip(e.behavior_logprobs, ref, e.action_mask)]
        r[-1] += e.reward
        expected.append([sum(r[t:]) if m else 0.0 for t, m in enumerate(e.action_mask)])

    async def main():
        group = TrainerGroup(1, estimator="reinforce", advantage_params={"gamma": 1.0, "lam": 1.0, "whiten": False})
        try:
            await group.setup({"model_name_or_path": str(tiny_llama_dir), "kl_coef": coef, "kl_use_loss": False,
                               "kl_estimator": "k1"})
            return await group.call("advantages", [exps], [{e.rollout_id: e.reward for e in exps}])
        finally:
            for rank in group.ranks:
                ray_local.kill(rank)
    (got,) = asyncio.run(main())
    for adv, want in zip(got, expected):
        assert adv == pytest.approx(want, abs=1e-4)
    assert any(abs(w - e.reward) > 0.05 for w, e in zip((w[3] for w in expected), exps))  # the KL moved them
