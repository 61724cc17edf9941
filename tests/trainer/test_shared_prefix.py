"""Shared prefixes: a prompt group's common context runs through the decoder once, and log-probs, entropy,
gradients and a whole optimizer step are the same as without sharing."""

import random

import pytest
import torch
from trainer_helpers import BASE, full_params, reference_logprobs
from transformers import AutoModelForCausalLM

from molt.trainer.batching import collate, shared_prefix
from molt.trainer.logprobs import CausalLMLogProbs
from molt.types import Experience


def test_shared_prefix_by_hand():
    # first actions at 3, 3, 2 -> length 1: prefixes (1,), (1,), (7,)
    p = shared_prefix(
        [[1, 2, 3, 4, 5], [1, 2, 3, 9, 9, 9], [7, 8, 9, 4]],
        [[0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 1], [0, 0, 1, 1]],
    )
    assert (p.length, p.rows.tolist(), p.index.tolist()) == (1, [0, 2], [0, 0, 1])
    # first actions at 4 and 3 -> length 2; both rows start [1, 2]
    p = shared_prefix([[1, 2, 3, 4, 5], [1, 2, 6, 7]], [[0, 0, 0, 0, 1], [0, 0, 0, 1]])
    assert (p.length, p.rows.tolist(), p.index.tolist()) == (2, [0], [0, 0])
    # a row without actions counts its whole length as context
    p = shared_prefix([[1, 2, 3], [1, 2, 3, 4]], [[0, 0, 0], [0, 0, 0, 1]])
    assert (p.length, p.index.tolist()) == (2, [0, 0])
    assert shared_prefix([[1, 2, 3]], [[0, 0, 1]]) is None  # one row
    assert shared_prefix([[1, 2, 3], [4, 2, 3]], [[0, 0, 1], [0, 0, 1]]) is None  # nothing in common
    assert shared_prefix([[1, 2, 3], [1, 2, 3]], [[0, 1, 1], [0, 0, 1]]) is None  # an action at position 1


def grouped_window(model_dir, groups=3, per_group=4, seed=0) -> list[Experience]:
    """Rows of a group share a prompt (groups differ in prompt length); completions differ in length."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(10, 380) for _ in range(rng.randint(4, 12))]
        for i in range(per_group):
            ids = prompt + [rng.randrange(10, 380) for _ in range(rng.randint(2, 14))]
            mask = [0] * len(prompt) + [1] * (len(ids) - len(prompt))
            temp = rng.choice([1.0, 0.7])
            ref = reference_logprobs(model_dir, ids, temp)
            out.append(
                Experience(
                    rollout_id=f"r{g}-{i}",
                    group_id=f"g{g}",
                    segment_index=0,
                    reward=0.0,
                    num_tokens=len(ids),
                    num_actions=sum(mask),
                    min_version=0,
                    temperature=temp,
                    token_ids=ids,
                    action_mask=mask,
                    behavior_logprobs=[(r + rng.uniform(-0.3, 0.3)) if m else 0.0 for r, m in zip(ref, mask)],
                    versions=[0 if m else -1 for m in mask],
                    advantages=[rng.gauss(0, 1) if m else 0.0 for m in mask],
                )
            )
    return out


@pytest.mark.parametrize("model_dir", ["tiny_llama_dir", "tiny_moe_dir"])
def test_logprobs_entropy_and_gradients_equal_the_unshared_pass(request, model_dir):
    path = request.getfixturevalue(model_dir)
    window = grouped_window(path)
    # one group whose prompts all differ at the last token: one prefix per row group, two distinct prefixes
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = CausalLMLogProbs(lm, chunk_size=7).train()
    results = []
    for share in (False, True):
        mb = collate(window, pad_id=0, device=torch.device("cpu"), share_prefix=share)
        assert (mb.prefix is not None) == share
        lm.zero_grad(set_to_none=True)
        lp, ent = model(mb, True)
        (lp * mb.advantages).sum().add(0.1 * ent.sum()).backward()
        results.append(
            (
                lp.detach(),
                ent.detach(),
                {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None},
            )
        )
    (lp0, ent0, g0), (lp1, ent1, g1) = results
    assert (
        mb.prefix.rows.numel() == 3
        and mb.prefix.length == min(len(e.token_ids) - e.num_actions for e in window) - 1
    )
    assert lp0.abs().sum() > 0 and (lp1 - lp0).abs().max() <= 1e-5 and (ent1 - ent0).abs().max() <= 1e-5
    assert g0.keys() == g1.keys() and len(g0) > 5
    for name in g0:
        assert torch.allclose(g1[name], g0[name], rtol=1e-4, atol=1e-6), name


def test_an_actor_step_is_the_same_with_and_without_sharing(tiny_llama_dir):
    from molt.trainer import Actor

    window = grouped_window(tiny_llama_dir, seed=1)
    runs = []
    for share in (False, True):
        actor = Actor.from_pretrained(tiny_llama_dir, **{"train.share_prefix": share}, **BASE)
        assert actor.share_prefix is share
        metrics = [actor.train_step(window) for _ in range(2)]
        runs.append((metrics, full_params(actor), actor.compute_logprobs(window)))
    (m0, p0, lp0), (m1, p1, lp1) = runs
    for a, b in zip(m0, m1):
        assert a["policy_loss"] == pytest.approx(b["policy_loss"], rel=1e-4, abs=1e-6)
        assert a["actor_grad_norm"] == pytest.approx(b["actor_grad_norm"], rel=1e-4)
    # Adam divides by sqrt(v): float rounding on near-zero gradients moves a weight by a few percent of lr (1e-3)
    assert max((p0[n] - p1[n]).abs().max().item() for n in p0) <= 5e-5
    assert max(abs(x - y) for r0, r1 in zip(lp0, lp1) for x, y in zip(r0, r1)) <= 1e-5
    # sharing needs one process and the KV cache: off with gradient checkpointing
    assert not Actor.from_pretrained(tiny_llama_dir, **{"actor.gradient_checkpoint": True}).share_prefix
