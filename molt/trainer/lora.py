"""LoRA adapters through PEFT: injected into the Hugging Face model in place (its class and module names stay, so
FSDP2 shards frozen base weights and trainable adapters in the same blocks), switched off for the reference
forward, sent alone to the embedded engine (which holds the same adapters), merged into the base weights for
vLLM's refit and for export, and saved in PEFT's own format.

Decisions (docs/lora.md): one adapter ("default") per model; the merged weight W + alpha / r * B @ A travels under
the base layer's Hugging Face name, so vLLM loads it by name like any refit; routed experts stored as fused
3-D parameters (Qwen2-MoE, Mixtral in transformers 5) are not nn.Linear and get no adapters.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from molt.config import OptimConfig

ADAPTER = "default"  # PEFT's name for the one adapter


def apply_lora(lm: nn.Module, o: OptimConfig) -> None:
    """Inject adapters into `lm`'s `o.lora_target_modules`; PEFT freezes every other parameter."""
    from peft import LoraConfig, inject_adapter_in_model

    inject_adapter_in_model(LoraConfig(**o.lora_options()), lm)


def lora_layers(lm: nn.Module) -> dict[str, nn.Module]:
    """{state-dict name of the base weight: LoRA layer} of a model with adapters ({} without)."""
    if not hasattr(lm, "peft_config"):  # set by `inject_adapter_in_model`; peft is not imported otherwise
        return {}
    from peft.tuners.lora import LoraLayer

    return {f"{n}.base_layer.weight": m for n, m in lm.named_modules() if isinstance(m, LoraLayer)}


@contextmanager
def adapters_off(lm: nn.Module) -> Iterator[None]:
    """Inside, `lm` (and whatever wraps it) runs the base model: every adapter is skipped, not multiplied by 0."""
    layers = lora_layers(lm).values()
    # PEFT's `enable_adapters(False)` also flips the adapters' requires_grad, which FSDP2's sharded and unsharded
    # parameter copies must not see between a forward and its backward; the flag alone is what forward reads
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m in layers:
            m._disable_adapters = False


def gathered(t: torch.Tensor) -> torch.Tensor:
    """The whole of `t` (a sharded DTensor gathered on every rank: collective)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def merged(layer: nn.Module) -> torch.Tensor:
    """W + scale * B @ A of one LoRA layer, in W's dtype, computed in fp32 from the gathered (full) tensors."""
    a, b = gathered(layer.lora_A[ADAPTER].weight).float(), gathered(layer.lora_B[ADAPTER].weight).float()
    w, delta = gathered(layer.base_layer.weight), (b @ a) * layer.scaling[ADAPTER]
    return (w.float() + (delta.T if layer.fan_in_fan_out else delta)).to(w.dtype)


def export_adapter(lm: nn.Module, path: str | Path, base: str, *, write: bool) -> None:
    """Write the adapter as PEFT's `save_pretrained` does (adapter_config.json, adapter_model.safetensors) for
    `PeftModel.from_pretrained(base_model, path)` and vLLM's LoRA loading. Collective; only `write` writes."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    tensors = {
        n: gathered(t).detach().cpu() for n, t in lm.state_dict(keep_vars=True).items() if ".lora_" in n
    }
    if not write:
        return
    state = get_peft_model_state_dict(lm, state_dict=tensors, adapter_name=ADAPTER)
    Path(path).mkdir(parents=True, exist_ok=True)
    save_file(
        {f"base_model.model.{k}": v.contiguous() for k, v in state.items()},
        str(Path(path) / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    config = copy.copy(lm.peft_config[ADAPTER])
    config.base_model_name_or_path, config.inference_mode = base, True
    config.save_pretrained(str(path))
