"""Weights out: a bucketed stream of full parameters in Hugging Face names (for refit), and a Hugging Face
checkpoint export written from that same stream.

Design notes and decisions: docs/internals.md, section `molt/trainer/weights.py`.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch
from torch import nn

from molt.trainer.lora import ADAPTER, gathered, lora_layers, merged


def _unique_weights(
    lm: nn.Module, refit: str = "", adapter: str = ADAPTER
) -> Iterator[tuple[str, torch.Tensor, Callable[[], torch.Tensor]]]:
    """(HF name, stored tensor, its full value) in state-dict order, a tied parameter once (under its first name).
    With LoRA adapters (`molt.trainer.lora`) a targeted layer appears as its merged weight under the base name and
    the factors not at all; refit="merged": then nothing else (the base weights never change); refit="adapters":
    the factors alone, under PEFT's names (for an engine that holds the same adapters: molt.engine.hf)."""
    layers, seen = lora_layers(lm), set()
    for name, t in lm.state_dict(keep_vars=True).items():
        if id(t) in seen or (".lora_" in name) != (refit == "adapters" and bool(layers)):
            continue
        seen.add(id(t))
        hf = name.replace(".base_layer.", ".")
        if name in layers:
            yield hf, t, partial(merged, layers[name], adapter)
        elif not (refit == "merged" and layers):
            yield hf, t, partial(gathered, t)


def plan_weight_buckets(
    lm: nn.Module, bucket_bytes: int = 256 << 20, *, dtype: torch.dtype | None = None, refit: str = ""
) -> list[list[tuple[str, tuple[int, ...], str]]]:
    """The buckets `iter_weight_buckets` yields, as (HF name, full shape, dtype name) without gathering anything:
    what a receiver needs to allocate before a collective refit. Local, not collective."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1 (got {bucket_bytes})")
    plan: list[list[tuple[str, tuple[int, ...], str]]] = []
    size = 0
    for name, t, _ in _unique_weights(lm, refit):
        out = dtype if dtype is not None and t.is_floating_point() else t.dtype
        nbytes = t.numel() * out.itemsize  # a DTensor reports its global shape and numel
        if not plan or (plan[-1] and size + nbytes > bucket_bytes):
            plan.append([])
            size = 0
        plan[-1].append((name, tuple(t.shape), str(out).removeprefix("torch.")))
        size += nbytes
    return plan


def iter_weight_buckets(
    lm: nn.Module,
    bucket_bytes: int = 256 << 20,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    refit: str = "",
    adapter: str = ADAPTER,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield lists of (HF name, full tensor) whose sizes sum to at most `bucket_bytes` (a larger tensor gets a
    bucket of its own), bucketed as `plan_weight_buckets` says. dtype: cast floating-point tensors (None keeps
    the stored dtype); `adapter`: the LoRA adapter merged (one of several)."""
    plan = plan_weight_buckets(lm, bucket_bytes, dtype=dtype, refit=refit)
    gather = {name: value for name, _, value in _unique_weights(lm, refit, adapter)}
    with torch.no_grad():
        for entries in plan:
            bucket = []
            for name, _, _ in entries:
                full = gather[name]()
                cast = dtype if dtype is not None and full.is_floating_point() else None
                bucket.append((name, full.detach().to(device, dtype=cast)))
            yield bucket


def export_hf(
    lm: nn.Module,
    path: str | Path,
    *,
    tokenizer_from: str | None = None,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = 1 << 30,
    write: bool = True,
    adapter: str = ADAPTER,
) -> Path:
    """Save `lm` as a Hugging Face checkpoint directory (LoRA adapter `adapter` merged). Collective over ranks;
    only `write=True` writes."""
    from safetensors.torch import save_file

    path = Path(path)
    weight_map: dict[str, str] = {}
    total = 0
    if write:
        path.mkdir(parents=True, exist_ok=True)
    for i, bucket in enumerate(iter_weight_buckets(lm, bucket_bytes, dtype=dtype, adapter=adapter)):
        if not write:
            continue
        fname = f"model-{i + 1:05d}.safetensors"
        # safetensors refuses views sharing storage; contiguous copies of one bucket are cheap
        save_file({n: t.contiguous() for n, t in bucket}, str(path / fname), metadata={"format": "pt"})
        for n, t in bucket:
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    if not write:
        return path
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    config = copy.deepcopy(lm.config)  # the live model keeps its own dtype
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(path)
    if getattr(lm, "generation_config", None) is not None:
        lm.generation_config.save_pretrained(path)
    if tokenizer_from:  # with a vision-language model's processor (image processor, chat template) too
        from transformers import AutoProcessor, AutoTokenizer

        auto = AutoProcessor if hasattr(config, "vision_config") else AutoTokenizer
        auto.from_pretrained(tokenizer_from).save_pretrained(path)
    return path
