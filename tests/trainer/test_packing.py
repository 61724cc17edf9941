"""Packed micro-batches (`--fsdp.packing_samples`): planning, layout, and the same log-probs, entropy, gradients
and optimizer steps as the padded layout in fp32."""

import pytest
import torch
from test_shared_prefix import grouped_window
from trainer_helpers import BASE, full_params, make_window
from transformers import AutoConfig, AutoModelForCausalLM

from molt.trainer import packing
from molt.trainer.batching import collate, plan_micro_batches, to_device
from molt.trainer.logprobs import CausalLMLogProbs
from molt.trainer.packing import register
from molt.types import Experience

CPU = torch.device("cpu")


def _exp(ids, mask, temperature=1.0):
    return Experience(
        rollout_id="r",
        group_id="g",
        segment_index=0,
        reward=0.0,
        num_tokens=len(ids),
        num_actions=sum(mask),
        min_version=0,
        temperature=temperature,
        token_ids=ids,
        action_mask=mask,
        behavior_logprobs=[-1.0 * m for m in mask],
        versions=[0] * len(ids),
        advantages=[float(m) for m in mask],
    )


def test_packed_plan_is_first_fit_decreasing_on_real_tokens():
    # sorted 9, 7, 5, 3, 1 into bins of 10: [9] [7] [5]; 3 fits the 7's bin; 1 fits the 9's bin
    assert plan_micro_batches([9, 5, 7, 3, 1], max_tokens_per_gpu=10, packed=True) == [[0, 4], [2, 3], [1]]
    assert plan_micro_batches([9, 5, 7, 3, 1], max_tokens_per_gpu=10) == [
        [0],
        [2],
        [1, 3],
        [4],
    ]  # padded: B * L
    assert plan_micro_batches([12, 3], max_tokens_per_gpu=10, packed=True) == [[0], [1]]  # too long: alone


def test_collate_packs_one_row_with_restarting_positions():
    mb = collate(
        [_exp([1, 2, 3], [0, 1, 1], temperature=0.5), _exp([4, 5], [0, 1])], pad_id=9, device=CPU, pack=True
    )
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5]] and mb.attention_mask is None
    assert mb.packing["position_ids"].tolist() == [[0, 1, 2, 0, 1]] and mb.seq_ids.tolist() == [
        [0, 0, 0, 1, 1]
    ]
    assert mb.packing["cu_seq_lens_q"].tolist() == [0, 3, 5] and mb.packing["max_length_q"] == 3
    assert mb.act_index.tolist() == [1, 2, 4] and mb.act_temperature.tolist() == [0.5, 0.5, 1.0]
    assert mb.spans == [(0, 0, 3, 0), (0, 3, 2, 0)] and mb.num_actions == 3 and not mb.ghost
    with pytest.raises(ValueError, match="action_mask"):  # a sequence's first token cannot be an action
        collate([_exp([1, 2], [0, 1]), _exp([4, 5], [1, 1])], pad_id=0, device=CPU, pack=True)


def test_a_shared_prefix_is_packed_once():
    mb = collate(
        [_exp([1, 2, 3, 4, 5], [0, 0, 0, 1, 1]), _exp([1, 2, 3, 9], [0, 0, 0, 1])],
        pad_id=0,
        device=CPU,
        pack=True,
        share_prefix=True,
    )
    # the prefix [1, 2] (up to the token before the first action) once, then each row's rest
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5, 3, 9]]
    assert mb.packing["position_ids"].tolist() == [[0, 1, 2, 3, 4, 2, 3]]
    assert mb.packing["molt_bounds"] == [0, 2, 5, 7] and mb.packing["molt_prefixes"] == [None, (0, 2), (0, 2)]
    assert mb.packing["molt_kv_index"].tolist() == [0, 1, 0, 1, 2, 3, 4, 0, 1, 5, 6]
    assert mb.packing["cu_seq_lens_k"].tolist() == [0, 2, 7, 11] and mb.packing["max_length_k"] == 5
    assert mb.act_index.tolist() == [3, 4, 6] and mb.spans == [(0, 2, 5, 2), (0, 5, 4, 2)]


def _per_experience(x, spans):
    return [torch.cat([torch.zeros(skip), x[r, s : s + n - skip]]) for r, s, n, skip in spans]


@pytest.mark.parametrize(
    "model_dir,share,scores",
    [
        ("tiny_llama_dir", False, None),
        ("tiny_llama_dir", True, None),
        ("tiny_moe_dir", True, None),
        ("tiny_llama_dir", True, 1),  # every piece alone, by scaled_dot_product_attention
        ("tiny_llama_dir", True, 3000),  # batches of a few pieces
    ],
)
def test_packed_logprobs_entropy_and_gradients_equal_the_padded_pass(
    request, monkeypatch, model_dir, share, scores
):
    if scores is not None:
        monkeypatch.setattr(packing, "BATCH_SCORES", scores)
    path = request.getfixturevalue(model_dir)
    window = grouped_window(path, seed=3)  # prompt groups: the packed rows share their prefixes when `share`
    results = []
    for pack in (False, True):
        attn = register() if pack else "sdpa"
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)
        model = CausalLMLogProbs(lm, chunk_size=7).train()
        mb = collate(window, pad_id=0, device=CPU, pack=pack, share_prefix=share and pack)
        assert not pack or not share or mb.input_ids.shape[1] < sum(len(e.token_ids) for e in window)
        lp, ent = model(mb, True)
        (lp * mb.advantages).sum().add(0.1 * ent.sum()).backward()
        per_exp = list(zip(_per_experience(lp.detach(), mb.spans), _per_experience(ent.detach(), mb.spans)))
        results.append((per_exp, {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}))
    (padded, g0), (packed, g1) = results
    assert sum(float(a.abs().sum()) for a, _ in padded) > 0
    for (lp0, ent0), (lp1, ent1) in zip(padded, packed):
        assert (lp1 - lp0).abs().max() <= 1e-5 and (ent1 - ent0).abs().max() <= 1e-5
    assert g0.keys() == g1.keys() and len(g0) > 5
    for name in g0:
        assert torch.allclose(g1[name], g0[name], rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("level", ["token", "geo"])
def test_packed_actor_steps_equal_padded_steps(tiny_llama_dir, level):
    from molt.trainer import Actor

    cfg = {**BASE, "algo.advantage.is_correction_level": level, "train.max_tokens_per_gpu": 64}
    windows = [
        make_window(tiny_llama_dir, seed=1),
        grouped_window(tiny_llama_dir, seed=2),
    ]  # one with prompt groups
    runs = []
    for pack in (False, True):  # padded: shared prefixes through the KV cache; packed: laid out once
        actor = Actor.from_pretrained(tiny_llama_dir, **{"fsdp.packing_samples": pack}, **cfg)
        metrics = [actor.train_step(w) for w in windows]
        lps = actor.compute_logprobs(grouped_window(tiny_llama_dir, seed=4))
        runs.append((metrics, full_params(actor), lps))
    (m0, p0, lp0), (m1, p1, lp1) = runs
    for a, b in zip(m0, m1):
        for key in ("policy_loss", "actor_grad_norm", "policy/pg_loss", "policy/entropy", "is/retained_frac"):
            assert b[key] == pytest.approx(a[key], abs=1e-5, rel=1e-5), key
    assert max(float((p0[k] - p1[k]).abs().max()) for k in p0) <= 1e-5
    assert all(len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= 1e-5 for a, b in zip(lp0, lp1))


@pytest.mark.parametrize("share", [False, True])
def test_the_flash_branch_traces_forward_and_backward_on_meta(tiny_llama_dir, monkeypatch, share):
    """The CUDA branch (varlen flash attention, which computes on a GPU only), traced on the meta device with
    this torch's `varlen_attn`: its arguments fit the signature (GQA, a shared prefix's keys), forward and
    backward, and every row's tokens go through it once."""
    if packing.varlen_attn is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    calls, real = [], packing.varlen_attn
    monkeypatch.setattr(packing, "_flash", lambda query: True)
    monkeypatch.setattr(packing, "varlen_attn", lambda *a, **k: calls.append((a, k)) or real(*a, **k))
    window = grouped_window(tiny_llama_dir, seed=3)
    host = collate(window, pad_id=0, device=CPU, pack=True, share_prefix=share)
    mb = to_device(collate(window, pad_id=0, device=CPU, pack=True, share_prefix=share), torch.device("meta"))
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(tiny_llama_dir), dtype=torch.bfloat16, attn_implementation=register()
        )
    lp, ent = CausalLMLogProbs(lm, chunk_size=7).train()(mb, True)
    (lp.float().sum() + ent.float().sum()).backward()
    assert len(calls) == lm.config.num_hidden_layers and lp.shape == mb.action_mask.shape
    (q, k, v, cu_q, cu_k, max_q, max_k), kwargs = calls[0]
    assert q.shape[0] == host.input_ids.shape[1] and k.shape[0] == int(host.packing["cu_seq_lens_k"][-1])
    assert (k.shape[0] > q.shape[0]) == share  # a shared prefix's keys are gathered again for each row
    assert v.shape == k.shape
    assert cu_q.dtype == cu_k.dtype == torch.int32 and isinstance(max_q, int) and isinstance(max_k, int)
    assert kwargs.get("is_causal") or kwargs.get("window_size") == (-1, 0)  # (a list would not be causal)
    assert k.shape[1] == q.shape[1] or kwargs.get("enable_gqa")  # GQA: repeated heads where torch cannot
    assert all(p.grad is not None and p.grad.device.type == "meta" for p in lm.parameters())
