"""The trainer on a GPU (skipped without CUDA; `scripts/gpu_check.sh` runs them): the fp32 engine-trainer gap,
packed varlen flash attention against padded SDPA, a one-rank mesh in bf16, and no host syncs per micro-batch
(CUDA's own sync debug mode counts them)."""

import asyncio
import warnings

import pytest
import torch
from test_shared_prefix import grouped_window
from trainer_helpers import BASE, make_window

from molt.types import Experience, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _engine_window(model_dir, temperature: float) -> list[Experience]:
    from molt.engine.hf import HFEngine

    async def sample():
        engine = HFEngine(str(model_dir), device="cuda")
        try:
            params = SamplingParams(max_tokens=32, min_tokens=32, temperature=temperature, seed=3)
            return await asyncio.gather(
                *[engine.generate(p, params) for p in ([5, 17, 40, 99, 3], [60, 61, 62])]
            )
        finally:
            await engine.close()

    out = []
    for i, (p, c) in enumerate(zip(([5, 17, 40, 99, 3], [60, 61, 62]), asyncio.run(sample()))):
        ids, mask = p + c.token_ids, [0] * len(p) + [1] * len(c.token_ids)
        out.append(
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
    return out


@pytest.mark.parametrize("pack", [False, True])
def test_fp32_engine_and_trainer_agree_on_cuda(tiny_llama_dir, pack):
    from molt.trainer import Actor

    window = _engine_window(tiny_llama_dir, 0.7)
    actor = Actor.from_pretrained(tiny_llama_dir, **{"actor.dtype": "float32", "fsdp.packing_samples": pack})
    assert actor.device.type == "cuda" and actor.mesh is not None  # one GPU: FSDP2 on a one-rank mesh
    gaps = [
        abs(r - b)
        for e, lp in zip(window, actor.compute_logprobs(window))
        for r, b, m in zip(lp, e.behavior_logprobs, e.action_mask)
        if m
    ]
    assert len(gaps) == 64 and max(gaps) <= 1e-4 and sum(gaps) / len(gaps) <= 1e-5


def test_packed_flash_attention_matches_padded_sdpa_in_bf16(tiny_llama_dir):
    from molt.trainer import Actor

    window = grouped_window(tiny_llama_dir, seed=5)
    lps = [
        Actor.from_pretrained(tiny_llama_dir, **{"fsdp.packing_samples": pack}).compute_logprobs(window)
        for pack in (False, True)
    ]
    gaps = [abs(a - b) for x, y in zip(*lps) for a, b in zip(x, y)]
    assert 0 < max(gaps) < 0.1  # bf16 both ways, different kernels


@pytest.mark.parametrize("level,loss", [("token", "ppo"), ("geo", "gspo")])
def test_bf16_step_has_no_host_sync_per_micro_batch(tiny_llama_dir, level, loss):
    from molt.trainer import Actor

    window = make_window(tiny_llama_dir, n=8, seed=1)
    counts = {}
    for budget in (10_000, 40):
        actor = Actor.from_pretrained(
            tiny_llama_dir,
            **{
                **BASE,
                "fsdp.device": "cuda",
                "train.max_tokens_per_gpu": budget,
                "actor.policy_loss": loss,
                "algo.advantage.is_correction_level": level,
                "fsdp.packing_samples": True,
            },
        )
        assert actor.param_dtype == torch.bfloat16
        actor.train_step(window)  # warm-up: lazy optimizer state, allocator
        plan, _, _ = actor.schedule(window)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                metrics = actor.train_step(window)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts[len(plan)] = sum("synchroniz" in str(w.message) for w in caught)
        assert metrics["actor_grad_norm"] > 0
    (_, n_one), (many, n_many) = sorted(counts.items())
    assert many >= 4 and n_many == n_one, counts
