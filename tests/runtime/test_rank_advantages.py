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
