"""Attention over packed rows: the `molt_varlen` attention implementation of transformers' AttentionInterface.

A packed micro-batch (`molt.trainer.batching`, `pack=True`) is one row [1, T] holding several sequences back to
back. Each token must attend causally within its own sequence only. transformers can build a block-diagonal
mask from restarting position ids, but for SDPA that mask is dense: a row of T tokens pays [T, T] attention
however short its sequences are, and finding the sequences reads the positions back from the device (a sync).
Instead the decoder runs with attention implementation "molt_varlen" (registered here, chosen at load time
when packing is on) and gets the sequence boundaries through its keyword arguments, built at collation:
- on CUDA, `torch.nn.attention.varlen.varlen_attn` (flash attention over cumulative sequence lengths: work
  proportional to sum(n_i^2), no mask, no padding, no sync; `max_length_q` is a host int);
- elsewhere (CPU, and fp32 on CUDA, which flash attention does not take), the pieces (`molt_bounds`, host ints)
  padded into one batch of plain matmuls and a masked fp32 softmax, as many pieces a batch as keep its scores
  within `BATCH_SCORES` (a piece too long for that alone: `scaled_dot_product_attention`). On the CPU a flash
  attention call costs about 1 ms forward and backward whatever its size: SmolLM2's 30 layers over the 18 short
  pieces of a vs-TRL step spent 0.7 s of a 2.6 s update there, and batched they take about a third of that.
A row's pieces are whole sequences, or, with prefix sharing, a prompt group's shared prefix once followed by
the rest of each of its sequences: such a piece attends to its prefix piece's keys and causally to its own
(`molt_prefixes`; on CUDA the keys are gathered per piece by `molt_kv_index`), which is exactly what each
sequence would see alone.
transformers builds no mask for an implementation it has no mask function for, so nothing else runs.

The trainer also loads with it for the padded layout when the model would have run transformers' "sdpa" and no
layer attends over a sliding window (`molt.trainer.base`): a padded micro-batch reaches the decoder without a
mask (`molt.trainer.batching`), and under "sdpa" transformers would then read the position ids back from the
device to look for packed sequences (a host sync per forward). Here it builds nothing and reads nothing:
`varlen_attention` hands a padded batch to transformers' own SDPA function, which runs causal without a mask
(after a shared prefix's cached keys too: zero queries in front of the rest's, their outputs dropped, as for a
packed piece after its prefix); a non-causal layer (a vision tower's) gets its own mask, or none, as under "sdpa".

Decision: sliding-window layers are refused (the varlen window would have to match the model's); so are
attention dropout in training and logit soft-capping (refused for the whole trainer in `logprobs.py`).
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "molt_varlen"

try:
    from torch.nn.attention.varlen import varlen_attn

    _VARLEN_ARGS = set(inspect.signature(varlen_attn).parameters)
except ImportError:  # older torch: the per-sequence path everywhere
    varlen_attn, _VARLEN_ARGS = None, set()


def _flash(query: Tensor) -> bool:
    """varlen flash attention: on CUDA, in half precision (flash attention takes no fp32)."""
    return query.is_cuda and varlen_attn is not None and query.dtype in (torch.float16, torch.bfloat16)


def varlen_attention(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask,
    scaling=None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] of one packed row -> ([1, T, Hq, D], None); a padded
    micro-batch (no `molt_bounds`) goes to transformers' SDPA (module docstring)."""
    if "molt_bounds" not in kwargs:
        # > 0 after a shared prefix's cached keys: queries padded in front so that SDPA's causal flag (top-left
        # aligned) lines them up with their keys, no [q, k] mask; those outputs are dropped
        p = key.shape[2] - query.shape[2]
        if p > 0:
            query = torch.cat([query.new_zeros(*query.shape[:2], p, query.shape[3]), query], 2)
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
        return out[:, p:], None
    if getattr(module, "sliding_window", None):
        raise ValueError("packing_samples: sliding-window attention layers are not supported")
    if dropout:
        raise ValueError("packing_samples: attention dropout is not supported")
    gqa = query.shape[1] != key.shape[1]
    prefixes = kwargs.get("molt_prefixes") or [None] * (len(kwargs["molt_bounds"]) - 1)
    if _flash(query):
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
        if "molt_kv_index" in kwargs:  # each piece's keys: its prefix piece's, then its own
            k, v = k.index_select(0, kwargs["molt_kv_index"]), v.index_select(0, kwargs["molt_kv_index"])
        if gqa and "enable_gqa" not in _VARLEN_ARGS:
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        extra = {"enable_gqa": gqa} if "enable_gqa" in _VARLEN_ARGS else {}
        # causal with fewer queries than keys aligns to the bottom right (flash attention's convention): a
        # piece's queries see all of its prefix and their own past
        extra.update({"is_causal": True} if "is_causal" in _VARLEN_ARGS else {"window_size": (-1, 0)})
        out = varlen_attn(
            q,
            k,
            v,
            kwargs["cu_seq_lens_q"],
            kwargs["cu_seq_lens_k"],
            kwargs["max_length_q"],
            kwargs["max_length_k"],
            scale=scaling,
            **extra,
        )
        return out.unsqueeze(0), None
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    outs = [
        _batched(query, key, value, batch, scale)
        if fits
        else _flash_piece(query, key, value, *batch[0], scale, gqa)
        for batch, fits in _batches(zip(itertools.pairwise(kwargs["molt_bounds"]), prefixes), query.shape[1])
    ]
    return torch.cat(outs, dim=0).unsqueeze(0), None


BATCH_SCORES = 1 << 22  # fp32 attention scores of one batch of pieces (16 MB, kept for the backward)


def _keys(piece) -> list[int]:
    """A piece's key positions in the row: its prefix piece's, then its own."""
    (a, b), head = piece
    return [*(range(*head) if head else ()), *range(a, b)]


def _batches(pieces, heads: int) -> Iterator[tuple[list, bool]]:
    """Consecutive pieces in batches whose padded [P, H, queries, keys] scores fit in `BATCH_SCORES`, each with
    whether it fits (False: one piece too long alone). Host arithmetic only: it runs for every layer."""
    batch, nq, nk = [], 0, 0
    for piece in pieces:
        (a, b), head = piece
        own = (b - a, b - a + (head[1] - head[0] if head else 0))  # its queries, its keys
        q, k = max(nq, own[0]), max(nk, own[1])
        if batch and (len(batch) + 1) * heads * q * k > BATCH_SCORES:
            yield batch, True
            batch, (q, k) = [], own
        batch.append(piece)
        nq, nk = q, k
        if heads * nq * nk > BATCH_SCORES:  # alone, as the batch was just flushed
            yield batch, False
            batch, nq, nk = [], 0, 0
    if batch:
        yield batch, True


def _flash_piece(query, key, value, bounds, head, scale, gqa) -> Tensor:
    """One piece by `scaled_dot_product_attention` -> [n, Hq, D]. After a prefix the piece runs as one causal
    sequence with the prefix's own queries run again and dropped: no [n, p + n] mask, which would make SDPA on
    the CPU keep [H, n, p + n] scores (gigabytes at 30K tokens)."""
    keys = torch.tensor(_keys((bounds, head)), device=query.device)
    # 4-D: on [H, L, D] inputs with enable_gqa, SDPA's backward gave other value gradients here (torch 2.13)
    q, k, v = (x.index_select(2, keys) for x in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return out[0, :, len(keys) - (bounds[1] - bounds[0]) :].transpose(0, 1)


def _batched(query, key, value, pieces: list, scale: float) -> Tensor:
    """Pieces padded into one batch -> their outputs back to back, [sum n, Hq, D]. Scores in fp32 (a bf16 matmul
    would round them before the softmax); a query sees its prefix and its own past; padded keys are masked, and
    padded queries see key 0 (no empty softmax row) and are dropped."""
    dev, hq, hk = query.device, query.shape[1], key.shape[1]
    lens, keys = [b - a for (a, b), _ in pieces], [_keys(p) for p in pieces]  # host ints: nothing read back
    nq, nk = max(lens), max(map(len, keys))
    q_at = torch.tensor([[*range(a, b), *[a] * (nq - b + a)] for (a, b), _ in pieces], device=dev)
    k_at = torch.tensor([[*k, *[k[0]] * (nk - len(k))] for k in keys], device=dev)
    past = torch.tensor([len(k) - n for k, n in zip(keys, lens)], device=dev)  # prefix lengths
    j, i = torch.arange(nk, device=dev), torch.arange(nq, device=dev)
    visible = j[None, None] <= past[:, None, None] + i[None, :, None]  # [P, nq, nk]; excludes padded keys too
    bias = torch.zeros(visible.shape, device=dev).masked_fill_(~visible, -math.inf)
    # [1, H, T, D] -> [P, Hkv, group, nq, D] and [P, Hkv, 1, nk, D]
    q = query[0][:, q_at].transpose(0, 1).unflatten(1, (hk, hq // hk))
    k, v = (x[0][:, k_at].transpose(0, 1)[:, :, None] for x in (key, value))
    scores = (q.float() @ k.float().transpose(-1, -2)).mul_(scale).add_(bias[:, None, None])
    out = scores.softmax(-1).to(v.dtype) @ v  # [P, Hkv, group, nq, D]
    out = out.flatten(1, 2).transpose(1, 2).flatten(0, 1)  # [P * nq, Hq, D]
    return out[torch.tensor([p * nq + t for p, n in enumerate(lens) for t in range(n)], device=dev)]


def register() -> str:
    """Make "molt_varlen" a valid `attn_implementation` of every transformers model; returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention)
    return NAME
