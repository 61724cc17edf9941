"""LoRA adapters through PEFT: injected into the Hugging Face model in place (its class and module names stay, so
FSDP2 shards frozen base weights and trainable adapters in the same blocks), switched off for the reference
forward, sent alone to the embedded engine (which holds the same adapters), merged into the base weights for
vLLM's refit and for export, and saved in PEFT's own format.

Decisions (docs/lora.md): one adapter ("default") per model, or one per role that learns (multiagent.adapters: each
micro-batch holds one role's experiences and runs through that role's adapter alone); the merged weight
W + alpha / r * B @ A travels under
the base layer's Hugging Face name, so vLLM loads it by name like any refit; routed experts stored as fused
3-D parameters (Qwen2-MoE, Mixtral in transformers 5) are not nn.Linear and get no adapters.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from molt.config import OptimConfig

ADAPTER = "default"  # PEFT's name for the one adapter


def apply_lora(lm: nn.Module, o: OptimConfig, names: list[str] | None = None) -> None:
    """Inject adapters into `lm`'s `o.lora_target_modules`, PEFT's one or one per name (role); PEFT freezes every
    other parameter."""
    from peft import LoraConfig, inject_adapter_in_model

    for name in names or [ADAPTER]:
        inject_adapter_in_model(LoraConfig(**o.lora_options()), lm, adapter_name=name)
    if names:
        for n, p in lm.named_parameters():  # PEFT freezes the adapters injected before the last one
            p.requires_grad_(".lora_" in n)
        for layer in lora_layers(lm).values():
            layer.register_forward_hook(_every_adapter_in_the_graph)


def _every_adapter_in_the_graph(layer: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor | None:
    """In training, the adapters a micro-batch does not use join the graph times 0: every rank then has a gradient
    (of 0) for each of them, so FSDP2 reduce-scatters the same parameters on every rank whatever roles it holds."""
    if not torch.is_grad_enabled():
        return None
    idle = [m[n].weight for m in (layer.lora_A, layer.lora_B) for n in m if n not in layer.active_adapters]
    return out + sum(w.sum() for w in idle) * 0.0 if idle else None


def use_adapter(lm: nn.Module, name: str | None) -> None:
    """Run `lm`'s LoRA layers through adapter `name` alone (None: none, the base model). PEFT's `set_adapter`
    would also flip `requires_grad` (see `adapters_off`)."""
    for layer in lora_layers(lm).values():
        layer._active_adapter = [name] if name else []


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


def merged(layer: nn.Module, adapter: str = ADAPTER) -> torch.Tensor:
    """W + scale * B @ A of one LoRA layer, in W's dtype, computed in fp32 from the gathered (full) tensors."""
    a, b = gathered(layer.lora_A[adapter].weight).float(), gathered(layer.lora_B[adapter].weight).float()
    w, delta = gathered(layer.base_layer.weight), (b @ a) * layer.scaling[adapter]
    return (w.float() + (delta.T if layer.fan_in_fan_out else delta)).to(w.dtype)


def export_adapter(
    lm: nn.Module, path: str | Path, base: str, *, write: bool, adapter: str = ADAPTER
) -> None:
    """Write the adapter as PEFT's `save_pretrained` does (adapter_config.json, adapter_model.safetensors) for
    `PeftModel.from_pretrained(base_model, path)` and vLLM's LoRA loading. Collective; only `write` writes."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    tensors = {
        n: gathered(t).detach().cpu() for n, t in lm.state_dict(keep_vars=True).items() if ".lora_" in n
    }
    if not write:
        return
    state = get_peft_model_state_dict(lm, state_dict=tensors, adapter_name=adapter)
    Path(path).mkdir(parents=True, exist_ok=True)
    save_file(
        {f"base_model.model.{k}": v.contiguous() for k, v in state.items()},
        str(Path(path) / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    config = copy.copy(lm.peft_config[adapter])
    config.base_model_name_or_path, config.inference_mode = base, True
    config.save_pretrained(str(path))
