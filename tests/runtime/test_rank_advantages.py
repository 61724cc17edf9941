"""Token-level estimators split over trainer ranks equal one computation over the whole window: group
baselines come from the controller, a rollout's segments stay on one rank, whitening is global."""

import asyncio
import random

import pytest
import torch

from molt.algo import AdvantageBatch, AdvantageParams, compute_advantages, estimator_spec
from molt.config import MoltConfig
from molt.config_resolve import override, resolve
from molt.runtime.experience import assign_to_ranks
from molt.runtime.trainer_group import TrainerGroup, terminal_rewards
from molt.types import Experience, expand_actions


def _window(seed: int = 0) -> list[Experience]:
    """4 groups x 3 rollouts, some with two segments (the second one's context tokens are mask 0)."""
    rng, exps = random.Random(seed), []
    for g in range(4):
        for r in range(3):
            reward = float(rng.choice([0.0, 1.0, 0.5]))
            for s in range(rng.choice([1, 2])):
                n = rng.randint(4, 9)
                mask = [0] * 2 + [1] * (n - 2)
                ids = [rng.randrange(10, 380) for _ in range(n)]
                exps.append(
                    Experience(
                        f"g{g}r{r}",
                        f"g{g}",
                        s,
                        reward,
                        n,
                        n - 2,
                        0,
                        token_ids=ids,
                        action_mask=mask,
                        behavior_logprobs=[0.0] * n,
                        versions=[0] * n,
                    )
                )
    return exps


@pytest.mark.parametrize("estimator", ["reinforce", "reinforce_baseline"])
def test_two_ranks_equal_one_window(tiny_llama_dir, ray_local, estimator):
    exps = _window()
    params = {"gamma": 0.9, "lam": 1.0}
    batch = AdvantageBatch.from_experiences(exps)
    expected = compute_advantages(estimator, batch, AdvantageParams(**params)).advantages
    rows = list({e.credit: (e.credit, e.group_id, e.reward) for e in exps}.values())
    rewards = terminal_rewards(estimator_spec(estimator).centred, rows)
    _assert_two_ranks_give(
        expected,
        exps,
        rewards,
        ray_local,
        TrainerGroup(2),
        _cfg(tiny_llama_dir, estimator, **{"algo.advantage.gamma": 0.9, "algo.advantage.lam": 1.0}),
        atol=1e-5,
    )


def _cfg(model_dir, estimator: str, **fields):
    """A run's resolved configuration with `estimator` (the trainer ranks' `setup` argument)."""
    return resolve(
        override(
            MoltConfig(),
            {"actor.model_name_or_path": str(model_dir), "algo.advantage.estimator": estimator, **fields},
        )
    )


def _assert_two_ranks_give(expected, exps, rewards, ray_local, group, *setup, atol, prepare=None):
    """Split `exps` over the group's two ranks, compute their advantages there, compare with `expected`."""
    shares = assign_to_ranks(exps, 2)

    async def main():
        try:
            await group.setup(*setup)
            for rank in group.ranks if prepare else []:
                await rank.__ray_call__.remote(*prepare)
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
            assert torch.allclose(torch.tensor(adv, dtype=want.dtype), want, atol=atol), exp.rollout_id


def _set_value_head(rank, weight: float, bias: float) -> None:
    """Give the critic's (zero-initialized) value head constant weights, on each rank's shard of it."""
    import torch

    with torch.no_grad():
        for name, p in rank.critic.model.named_parameters():
            if "value_head" in name:
                (p.to_local() if hasattr(p, "to_local") else p).fill_(
                    weight if name.endswith("weight") else bias
                )


def test_gae_on_two_ranks_equals_one_window_with_independent_values(tiny_llama_dir, ray_local):
    """GAE split over two FSDP2 ranks (each rank's critic values for its own rollouts, one whitening all-reduce)
    equals GAE over the whole window with values from a plain forward of the backbone: V_t = w * sum(h_{t-1}) + b
    on action tokens."""
    import sys

    import ray.cloudpickle
    from transformers import AutoModel

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    exps, (w, b) = _window(1), (0.01, 0.3)
    backbone = AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    length = max(e.num_tokens for e in exps)
    values = torch.zeros(len(exps), length)
    for i, e in enumerate(exps):
        with torch.no_grad():
            h = backbone(torch.tensor([e.token_ids])).last_hidden_state[0]
        v = torch.cat([torch.zeros(1), w * h.sum(-1)[:-1] + b])
        values[i, : e.num_tokens] = torch.where(torch.tensor(e.action_mask, dtype=torch.bool), v, 0.0)
    params = {"gamma": 0.9, "lam": 0.8}
    expected = compute_advantages(
        "gae", AdvantageBatch.from_experiences(exps, values=values), AdvantageParams(**params)
    ).advantages
    cfg = _cfg(tiny_llama_dir, "gae", **{"algo.advantage.gamma": 0.9, "algo.advantage.lam": 0.8})
    _assert_two_ranks_give(
        expected,
        exps,
        {e.rollout_id: e.reward for e in exps},
        ray_local,
        TrainerGroup(2),
        cfg,
        atol=1e-4,
        prepare=(_set_value_head, w, b),
    )
    # the values mattered: GAE with zero values (plain discounted returns) differs
    zero = compute_advantages(
        "gae",
        AdvantageBatch.from_experiences(exps, values=torch.zeros_like(values)),
        AdvantageParams(**params),
    ).advantages
    assert (zero - expected).abs().max() > 0.05


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
        exps.append(
            Experience(
                f"r{i}",
                "g",
                0,
                float(i),
                n,
                n - 3,
                0,
                token_ids=ids,
                action_mask=mask,
                behavior_logprobs=blp,
                versions=[0] * n,
            )
        )
    expected = []
    for e in exps:
        ref = reference_logprobs(tiny_llama_dir, e.token_ids, 1.0)
        blp = expand_actions(e.behavior_logprobs, e.action_mask, 0.0)  # stored for action tokens only
        r = [-coef * (b - q) if m else 0.0 for b, q, m in zip(blp, ref, e.action_mask)]
        r[-1] += e.reward
        expected.append([sum(r[t:]) if m else 0.0 for t, m in enumerate(e.action_mask)])

    async def main():
        group = TrainerGroup(1)
        try:
            await group.setup(
                _cfg(
                    tiny_llama_dir,
                    "reinforce",
                    **{
                        "algo.advantage.no_whiten": True,
                        "algo.kl.init_coef": coef,
                        "algo.kl.use_loss": False,
                        "algo.kl.estimator": "k1",
                    },
                )
            )
            return await group.call("advantages", [exps], [{e.rollout_id: e.reward for e in exps}])
        finally:
            for rank in group.ranks:
                ray_local.kill(rank)

    (got,) = asyncio.run(main())
    for adv, want in zip(got, expected):
        assert adv == pytest.approx(want, abs=1e-4)
    assert any(abs(w - e.reward) > 0.05 for w, e in zip((w[3] for w in expected), exps))  # the KL moved them


TOKEN_PLUGIN = """
from molt.algo import AdvantageResult, register_estimator
from molt.algo.advantages import reinforce


@register_estimator("test_double_reinforce", "token")
def double_reinforce(batch, params):
    r = reinforce(batch, params)
    return AdvantageResult(2 * r.advantages, r.returns)
"""


def test_a_token_estimator_registered_by_the_user_runs_on_the_ranks(tiny_llama_dir, ray_local, tmp_path):
    """The ranks import `algo.plugins` themselves (a Ray actor never saw the driver's imports) and run the
    estimator the registry declares a token one, with the controller's rewards as they are."""
    from molt.algo import import_files

    plugin = tmp_path / "double.py"
    plugin.write_text(TOKEN_PLUGIN)
    import_files([str(plugin)])
    assert estimator_spec("test_double_reinforce").kind == "token"
    exps = _window(2)
    batch = AdvantageBatch.from_experiences(exps)
    expected = compute_advantages(
        "test_double_reinforce", batch, AdvantageParams(gamma=0.9, whiten=False)
    ).advantages
    rows = list({e.credit: (e.credit, e.group_id, e.reward) for e in exps}.values())
    cfg = _cfg(
        tiny_llama_dir,
        "test_double_reinforce",
        **{"algo.plugins": [str(plugin)], "algo.advantage.gamma": 0.9, "algo.advantage.no_whiten": True},
    )
    _assert_two_ranks_give(
        expected, exps, terminal_rewards(False, rows), ray_local, TrainerGroup(2), cfg, atol=1e-5
    )
