"""Chunked log-probs: equal to a full-logits reference (values and gradients), and to the embedded engine's
behavior log-probs for the same tokens at temperature 1 and 0.7."""

import numpy as np
import pytest
import torch

from molt.trainer.logprobs import action_logprobs, check_supported
from molt.types import Experience, SamplingParams


def _naive(hidden, weight, bias, ids, mask, temp):
    logp = torch.log_softmax((hidden @ weight.T + bias).float() / temp[:, None, None], -1)
    lp = torch.zeros(mask.shape)
    lp[:, 1:] = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    ent = torch.zeros(mask.shape)
    ent[:, 1:] = -(logp.exp() * logp).sum(-1)[:, :-1]
    return lp * mask, ent * mask


@pytest.mark.parametrize("chunk,with_bias", [(1, False), (3, True), (1000, False)])
def test_chunked_matches_full_logits_values_and_grads(chunk, with_bias):
    torch.manual_seed(0)
    b, length, h, v = 3, 7, 8, 50
    hidden = torch.randn(b, length, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(v, dtype=torch.float64, requires_grad=True) if with_bias else None
    ids = torch.randint(0, v, (b, length))
    mask = torch.rand(b, length) > 0.4
    mask[:, 0] = False
    temp = torch.tensor([1.0, 0.7, 0.0], dtype=torch.float64)  # 0 counts as 1, as in the engine
    idx = mask.flatten().nonzero()[:, 0]  # the action tokens' flat positions, as collation gives them
    lp, ent = action_logprobs(
        hidden,
        weight,
        bias,
        ids,
        idx,
        temp[:, None].expand_as(mask).flatten()[idx],
        chunk_size=chunk,
        with_entropy=True,
    )
    ref_lp, ref_ent = _naive(
        hidden, weight, 0.0 if bias is None else bias, ids, mask, torch.where(temp > 0, temp, 1.0)
    )
    assert torch.allclose(lp, ref_lp.float(), atol=1e-6) and torch.allclose(ent, ref_ent.float(), atol=1e-5)
    g = torch.randn(b, length)
    inputs = (hidden, weight) + ((bias,) if with_bias else ())
    for ent_coef in (0.3, 0.0):  # with 0 the entropy output is unused: its gradient is never formed
        loss = ((lp + ent_coef * ent) * g).sum() if ent_coef else (lp * g).sum()
        grads = torch.autograd.grad(loss, inputs, retain_graph=True)
        ref_grads = torch.autograd.grad(((ref_lp + ent_coef * ref_ent) * g).sum(), inputs, retain_graph=True)
        for a, r in zip(grads, ref_grads):
            assert torch.allclose(a, r, atol=1e-5)


def test_softcap_is_refused():
    class Cfg:
        final_logit_softcapping = 30.0

    with pytest.raises(ValueError, match="final_logit_softcapping"):
        check_supported(Cfg())


@pytest.fixture(scope="module")
def actor(tiny_llama_dir):
    from molt.trainer import Actor

    return Actor.from_pretrained(tiny_llama_dir, **{"actor.logprob_chunk_size": 16})


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_recomputed_logprobs_match_engine(actor, tiny_llama_dir, temperature):
    from molt.engine.hf import HFEngine

    engine = HFEngine(str(tiny_llama_dir))
    try:
        prompts = [[5, 17, 40, 99, 3], [60, 61, 62]]
        params = SamplingParams(max_tokens=24, temperature=temperature, seed=7)
        completions = [await engine.generate(p, params) for p in prompts]
    finally:
        await engine.close()
    exps = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids = p + c.token_ids
        mask = [0] * len(p) + [1] * len(c.token_ids)
        exps.append(
            Experience(
                rollout_id=str(i),
                group_id="g",
                segment_index=0,
                reward=0.0,
                num_tokens=len(ids),
                num_actions=len(c.token_ids),
                min_version=0,
                temperature=temperature,
                token_ids=ids,
                action_mask=mask,
                behavior_logprobs=[0.0] * len(p) + c.logprobs,
                versions=[-1] * len(p) + c.versions,
            )
        )
    recomputed = actor.compute_logprobs(exps)
    gaps = np.concatenate(
        [np.abs(lp[e.action_mask] - e.behavior_logprobs) for e, lp in zip(exps, recomputed)]
    )
    assert len(gaps) > 10
    assert sum(gaps) / len(gaps) <= 1e-5
