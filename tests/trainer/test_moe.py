"""Routing replay (R3) on the tiny Qwen2-MoE, fp32 on the CPU: the embedded engine records every token's experts,
the capture path aligns them with the segment, and the trainer replays them (molt.trainer.moe)."""

import asyncio

import numpy as np
import pytest
import torch

from molt.engine.hf import HFEngine
from molt.trainer import Actor
from molt.types import Experience, SamplingParams

PROMPTS = [[5, 17, 42, 99, 7, 250, 31], [8, 9, 10], [200, 201, 3, 44, 45, 46, 47, 48, 49, 50, 51, 12]]


def reference_routes(model_dir, ids: list[int]) -> np.ndarray:
    """[len(ids), layers, k] top-k of softmax(router logits) from one plain forward (no cache, no batch)."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = lm(torch.tensor([ids]), output_router_logits=True).router_logits
    k = lm.config.num_experts_per_tok
    return torch.stack([torch.softmax(x.float(), -1).topk(k).indices for x in logits], 1).numpy()


@pytest.fixture(scope="module")
def sampled(tiny_moe_dir):
    """Three concurrent requests (one batch, left-padded), then a second turn of session "s" over the prefix
    cache: (prompt, Completion) pairs."""
    engine = HFEngine(str(tiny_moe_dir))

    async def main():
        params = SamplingParams(max_tokens=10, temperature=1.0, seed=3, stop_token_ids=[])
        first = await asyncio.gather(
            *(engine.generate(p, params, session_id=f"s{i}") for i, p in enumerate(PROMPTS))
        )
        turn2 = PROMPTS[0] + first[0].token_ids + [60, 61, 62]
        second = await engine.generate(turn2, params, session_id="s0")
        return list(zip(PROMPTS, first)) + [(turn2, second)], engine.prefixes.reused_tokens

    try:
        out, reused = asyncio.run(main())
    finally:
        asyncio.run(engine.close())
    assert reused > 0  # the second turn's prefix came from the cache (with its routes)
    return out


def _experience(prompt, c, i) -> Experience:
    ids = prompt + c.token_ids
    routes = np.zeros((len(ids), *c.routed_experts.shape[1:]), c.routed_experts.dtype)
    routes[:-1] = c.routed_experts
    mask = [0] * len(prompt) + [1] * len(c.token_ids)
    return Experience(
        rollout_id=f"r{i}",
        group_id="g",
        segment_index=0,
        reward=0.0,
        num_tokens=len(ids),
        num_actions=len(c.token_ids),
        min_version=0,
        token_ids=ids,
        action_mask=mask,
        behavior_logprobs=[0.0] * len(prompt) + c.logprobs,
        versions=[0] * len(ids),
        advantages=[0.5 * m for m in mask],
        routed_experts=routes,
    )


def test_engine_records_every_tokens_experts_compactly(tiny_moe_dir, sampled):
    for prompt, c in sampled:
        ids = prompt + c.token_ids
        assert c.routed_experts.dtype == np.uint8 and c.routed_experts.shape == (len(ids) - 1, 2, 2)
        ref = reference_routes(tiny_moe_dir, ids)[:-1]  # the last token never ran through the engine
        np.testing.assert_array_equal(np.sort(c.routed_experts, -1), np.sort(ref, -1))


async def test_a_refit_mid_request_keeps_each_positions_first_route(tiny_moe_dir, tmp_path):
    """Partial rollout: tokens sampled before the refit keep the old weights' routes, later ones get the new."""
    from molt.testing.models import build_tiny_moe

    new_dir = build_tiny_moe(tmp_path / "v1", seed=1)
    engine = HFEngine(str(tiny_moe_dir))
    started = asyncio.Event()
    task = asyncio.create_task(
        engine.generate(
            PROMPTS[0],
            SamplingParams(max_tokens=12, seed=1, stop_token_ids=[]),
            on_tokens=lambda ids: started.set(),
        )
    )
    await started.wait()
    await engine.pause()
    from transformers import AutoModelForCausalLM

    await engine.update_weights(AutoModelForCausalLM.from_pretrained(new_dir).state_dict().items(), version=1)
    await engine.resume()
    c = await task
    await engine.close()
    ids, cut = PROMPTS[0] + c.token_ids, len(PROMPTS[0]) + c.versions.count(0) - 1  # first position run again
    assert 0 < c.versions.count(0) < len(c.versions)
    old, new = reference_routes(tiny_moe_dir, ids)[:-1], reference_routes(new_dir, ids)[:-1]
    assert not np.array_equal(np.sort(old, -1), np.sort(new, -1))
    np.testing.assert_array_equal(np.sort(c.routed_experts[:cut], -1), np.sort(old[:cut], -1))
    np.testing.assert_array_equal(np.sort(c.routed_experts[cut:], -1), np.sort(new[cut:], -1))


FAMILIES = {  # tiny configs of the four families; both normalisations of the top-k weights
    "Qwen2MoeConfig": {
        "num_experts": 4,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
        "norm_topk_prob": True,
    },
    "Qwen3MoeConfig": {"num_experts": 4, "moe_intermediate_size": 16, "norm_topk_prob": False},
    "MixtralConfig": {"num_local_experts": 4, "intermediate_size": 16},
    "OlmoeConfig": {"num_experts": 4, "intermediate_size": 16, "norm_topk_prob": True},
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_replays_its_own_routes_exactly(family):
    """Replaying the routes the model would choose itself changes nothing (the family's weights are rebuilt
    exactly); other routes change the log-probs."""
    import transformers

    from molt.config import MoltConfig
    from molt.config_resolve import override
    from molt.trainer.batching import collate
    from molt.trainer.logprobs import CausalLMLogProbs
    from molt.trainer.moe import Routing

    config = getattr(transformers, family)(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        **FAMILIES[family],
    )
    torch.manual_seed(0)
    lm = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for router in lm.modules():  # a visible router (random init is near zero: near ties everywhere)
        if type(router).__name__.endswith("TopKRouter"):
            router.weight.data.normal_(0, 1.0)
    ids = list(range(3, 40))
    with torch.no_grad():
        logits = lm(torch.tensor([ids]), output_router_logits=True).router_logits
    own = torch.stack([torch.softmax(x.float(), -1).topk(2).indices for x in logits], 1).numpy()
    cfg = override(MoltConfig(), {"train.routing_replay": True})
    model = CausalLMLogProbs(lm, routing=Routing(lm, cfg))
    assert len(model.routing.routers) == 2

    def logprobs(routes):
        exp = Experience(
            rollout_id="r",
            group_id="g",
            segment_index=0,
            reward=0.0,
            num_tokens=len(ids),
            num_actions=len(ids) - 1,
            min_version=0,
            token_ids=ids,
            action_mask=[0] + [1] * (len(ids) - 1),
            behavior_logprobs=[0.0] * len(ids),
            versions=[0] * len(ids),
            routed_experts=routes,
        )
        with torch.no_grad():
            return model(collate([exp], 0, torch.device("cpu"), need_advantages=False))[0]

    replayed = logprobs(own)
    model.routing.replay = False
    torch.testing.assert_close(replayed, logprobs(own), rtol=0, atol=1e-6)
    model.routing.replay = True
    assert (logprobs((own + 1) % 4) - replayed).abs().max() > 1e-3


def _actor(path, **kw):
    """kw: trainer fields by their last name (routing_replay=True)."""
    names = {
        "routing_replay": "train",
        "packing_samples": "fsdp",
        "freeze_moe_router": "actor",
        "aux_loss_coef": "actor",
    }
    return Actor.from_pretrained(
        path,
        **{
            "fsdp.device": "cpu",
            "actor.adam.lr": 1e-3,
            "algo.advantage.is_correction_level": "off",
            **{f"{names[k]}.{k}": v for k, v in kw.items()},
        },
    )


def _perturb(actor, scale: float, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in actor.routing.routers:
            router.weight += scale * torch.randn(router.weight.shape, generator=gen)


def _step_metrics(path, exps, scale, **kw):
    actor = _actor(path, **kw)
    _perturb(actor, scale)
    return actor.train_step(exps)


def test_perturbed_router_lowers_agreement_and_replay_closes_the_gap(tiny_moe_dir, sampled):
    exps = [_experience(p, c, i) for i, (p, c) in enumerate(sampled)]
    base, small, large = (_step_metrics(tiny_moe_dir, exps, s) for s in (0.0, 0.05, 0.5))
    assert base["moe/route_agreement"] == 1.0 and base["moe/logprob_gap"] < 1e-5
    assert large["moe/route_agreement"] < small["moe/route_agreement"] <= 1.0
    assert large["moe/route_agreement"] < 0.9
    assert large["moe/logprob_gap"] > small["moe/logprob_gap"] > base["moe/logprob_gap"]
    replayed = _step_metrics(tiny_moe_dir, exps, 0.5, routing_replay=True)
    # the same forward without replay measures the same mismatch; replay removes the part from the choice of experts
    assert replayed["moe/route_agreement"] == pytest.approx(large["moe/route_agreement"])
    assert replayed["moe/logprob_gap"] == pytest.approx(large["moe/logprob_gap"], rel=1e-4)
    assert replayed["is/logprob_gap"] < replayed["moe/logprob_gap"]


def test_replay_reproduces_the_engine_and_the_router_still_learns(tiny_moe_dir, sampled):
    exps = [_experience(p, c, i) for i, (p, c) in enumerate(sampled)]
    # padded, and packed with the two turns of session s0 sharing their prefix (routes laid out like the tokens)
    for actor in (
        _actor(tiny_moe_dir, routing_replay=True, packing_samples=True),
        _actor(tiny_moe_dir, routing_replay=True),
    ):
        for exp, lp in zip(exps, actor.compute_logprobs(exps)):
            np.testing.assert_allclose(lp[exp.action_mask], exp.behavior_logprobs, atol=1e-5)
    # replay is really used: other routes give other log-probs
    shifted = [_experience(p, c, i) for i, (p, c) in enumerate(sampled)]
    for exp in shifted:
        exp.routed_experts = (exp.routed_experts + 1) % 4
    moved = actor.compute_logprobs(shifted)
    assert max(np.abs(lp[e.action_mask] - e.behavior_logprobs).max() for e, lp in zip(exps, moved)) > 1e-2
    # the gate's weights come from the trainer's router logits: the router gets a gradient
    from molt.trainer.batching import collate

    mb = collate(exps, actor.pad_id, actor.device)
    actor.model(mb)[0].sum().backward()
    grads = [r.weight.grad for r in actor.routing.routers]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    frozen = _actor(tiny_moe_dir, routing_replay=True, freeze_moe_router=True)
    frozen.model(mb)[0].sum().backward()
    assert all(r.weight.grad is None for r in frozen.routing.routers)


def test_aux_loss_and_bad_configurations(tiny_moe_dir, tiny_llama_dir, sampled):
    from transformers import AutoModelForCausalLM

    prompt, c = sampled[0]
    m = _actor(tiny_moe_dir, aux_loss_coef=0.01).train_step([_experience(prompt, c, 0)])
    lm = AutoModelForCausalLM.from_pretrained(
        tiny_moe_dir, dtype=torch.float32
    )  # by hand: Switch loss per layer
    with torch.no_grad():
        logits = lm(torch.tensor([prompt + c.token_ids]), output_router_logits=True).router_logits
    expected = []
    for x in logits:
        p = torch.softmax(x, -1)
        f = torch.nn.functional.one_hot(p.topk(2).indices, 4).sum(1).float().mean(0)
        expected.append(4 * (f * p.mean(0)).sum().item())
    assert m["moe/aux_loss"] == pytest.approx(sum(expected) / len(expected), rel=1e-5)
    with pytest.raises(ValueError, match="no MoE router"):
        _actor(tiny_llama_dir, routing_replay=True)
    exp = _experience(prompt, c, 0)
    exp.routed_experts = None
    with pytest.raises(ValueError, match="routing_replay"):
        _actor(tiny_moe_dir, routing_replay=True).compute_logprobs([exp])
