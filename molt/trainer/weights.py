"""Weights out: a bucketed stream of full parameters in Hugging Face names (for refit), and a Hugging Face
checkpoint export written from that same stream.

Decisions:
- Names are those of the Hugging Face model's own `state_dict()` (no wrapper prefix), so engines load them
  with their usual name mapping (vLLM `load_weights`, transformers `load_state_dict`).
- Tied embeddings: a parameter shared by several names is yielded once, under the first name in state-dict
  order, which for every tied HF model is the input embedding (`model.embed_tokens.weight`); `lm_head.weight`
  is skipped. Consumers tie it back: transformers through `tie_word_embeddings`, vLLM by skipping
  `lm_head.weight` for tied models.
- Memory: a sharded parameter (DTensor) is gathered with `full_tensor()` one parameter at a time and moved to
  `device` (CPU by default) at once, so a rank never holds more than one bucket of full weights besides its
  shards. The stream is collective: every rank must iterate it to the end (every rank receives full buckets;
  usually only one of them sends them on).
- Persistent buffers are part of the state dict and are streamed; non-persistent ones (rotary tables) are not.
- Export writes each bucket as one safetensors shard plus `model.safetensors.index.json`, so no rank ever
  builds the whole state dict; config, generation config and tokenizer are saved next to it.
"""
from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn


def iter_weight_buckets(lm: nn.Module, bucket_bytes: int = 256 << 20, *, dtype: torch.dtype | None = None,
                        device: str | torch.device = "cpu") -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield lists of (HF name, full tensor) whose sizes sum to at most `bucket_bytes` (a larger tensor gets a
    bucket of its own). dtype: cast floating-point tensors (None keeps the stored dtype)."""
    from torch.distributed.tensor import DTensor

    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1 (got {bucket_bytes})")
    seen: set[int] = set()
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    with torch.no_grad():
        for name, t in lm.state_dict(keep_vars=True).items():
            if id(t) in seen:  # tied: the same parameter under a second name
                continue
            seen.add(id(t))
            full = t.full_tensor() if isinstance(t, DTensor) else t
            full = full.detach().to(device, dtype=dtype if dtype is not None and full.is_floating_point() else None)
            nbytes = full.numel() * full.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, full))
            size += nbytes
    if bucket:
        yield bucket


def export_hf(lm: nn.Module, path: str | Path, *, tokenizer_from: str | None = None,
              dtype: torch.dtype | None = None, bucket_bytes: int = 1 << 30, write: bool = True) -> Path:
    """Save `lm` as a Hugging Face checkpoint directory. Collective over ranks; only `write=True` writes."""
    from safetensors.torch import save_file

    path = Path(path)
    weight_map: dict[str, str] = {}
    total = 0
    if write:
        path.mkdir(parents=True, exist_ok=True)
    for i, bucket in enumerate(iter_weight_buckets(lm, bucket_bytes, dtype=dtype)):
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
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config = copy.deepcopy(lm.config)  # the live model keeps its own dtype
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(path)
    if getattr(lm, "generation_config", None) is not None:
        lm.generation_config.save_pretrained(path)
    if tokenizer_from:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(path)
    return path
