"""Small tensor helpers shared by the algorithm files: the named registry, masked reductions, whitening,
per-sequence sums for packed rows, and the reverse discounted scan.

Design notes and decisions: docs/internals.md, section `molt/algo/ops.py`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch import Tensor

from molt.types import import_file

F = TypeVar("F", bound=Callable)


class Registry(dict):
    """A name -> function dict filled by a decorator: `@REG.register("name")`. Looking up an unknown name
    raises ValueError listing the known names."""

    __slots__ = ("kind",)

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def register(self, name: str) -> Callable[[F], F]:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string (got {name!r})")

        def deco(fn: F) -> F:
            taken = self.setdefault(name, fn)
            if _origin(taken) != _origin(fn):
                raise ValueError(
                    f"{self.kind} {name!r} is already registered (by {getattr(taken, '__qualname__', taken)})"
                )
            return fn

        return deco

    def get_fn(self, name: str) -> Callable:
        if name not in self:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {sorted(self)}")
        return self[name]


def _origin(fn: Callable) -> object:
    """Where a function was defined. A file imported again (a second load, another module name, a Ray worker's
    copy) makes new function objects with the same file and name: those register once, as the first."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    return fn if code is None else (code.co_filename, fn.__qualname__)


def import_files(paths: list[str], what: str = "plugins") -> None:
    """Import Python files that register variants (`algo.plugins`), each once per process: a registry is filled
    on import, and the controller and every trainer rank need the same names."""
    for entry in paths:
        path = Path(entry).resolve()
        if not path.is_file() or path.suffix != ".py":
            raise ValueError(f"{what}: cannot import {entry}")
        import_file(path, "molt_plugin", once=True)


def as_mask(action_mask: Tensor, like: Tensor | None = None, name: str = "action_mask") -> Tensor:
    """Bool view of a [N, T] action mask; ValueError (naming `name`) when its shape differs from `like`."""
    if action_mask.dim() != 2:
        raise ValueError(f"{name} must be [N, T] (got shape {tuple(action_mask.shape)})")
    if like is not None and like.shape != action_mask.shape:
        raise ValueError(f"{name} shape {tuple(action_mask.shape)} != tensor shape {tuple(like.shape)}")
    return action_mask.bool()


def check_shape(name: str, x: Tensor | None, shape: torch.Size | tuple) -> None:
    if x is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} (got {tuple(x.shape)})")


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """Sum of x over true positions of mask (same shape). Scalar."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over true positions; 0 when the mask is empty. Scalar."""
    return masked_sum(x, mask) / mask.sum().clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the true positions of mask, zero elsewhere. Same shape as x.
    Constant or empty inputs give zeros."""
    x64 = torch.where(mask, x.double(), 0.0)
    n = mask.sum().clamp(min=1)
    mean = x64.sum() / n
    var = torch.where(mask, (x64 - mean) ** 2, 0.0).sum() / n
    out = (x64 - mean) * torch.rsqrt(var + eps)
    return torch.where(mask, out, 0.0).to(x.dtype)


def seq_sum(x: Tensor, mask: Tensor, seq_ids: Tensor | None = None) -> Tensor:
    """Per-token broadcast of the sum of x over the action tokens of each token's sequence. [N, T] -> [N, T].

    seq_ids: optional [N, T] integer tensor naming the sequence of every token when several sequences are
    packed into one row: ids in [0, N * T) (equal ids = same sequence, across rows too; collation numbers them
    0..S-1). None: one sequence per row. Gradients flow to every action token of the sequence.
    Decision: the sums go into a buffer of N * T slots, more than there can be sequences, so nothing depends on
    the values of the ids (no `unique`, no max): no read from the device."""
    xm = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if seq_ids is None:
        return xm.sum(dim=1, keepdim=True).expand_as(x)
    check_shape("seq_ids", seq_ids, x.shape)
    ids = seq_ids.reshape(-1)
    sums = torch.zeros(ids.numel(), dtype=x.dtype, device=x.device).index_add(0, ids, xm.reshape(-1))
    return sums[ids].view(x.shape)


def seq_mean(x: Tensor, mask: Tensor, seq_ids: Tensor | None = None) -> Tensor:
    """Per-token broadcast of the mean of x over each token's sequence (0 for sequences without actions)."""
    count = seq_sum(mask.to(x.dtype), mask, seq_ids).clamp(min=1)
    return seq_sum(x, mask, seq_ids) / count


def discounted_reverse_cumsum(x: Tensor, gamma: float) -> Tensor:
    """out[:, k] = sum_{j >= k} gamma^(j - k) x[:, j] along the last dim. [R, L] -> [R, L].

    gamma == 1 uses one cumsum; otherwise a reverse scan over L vectorized over rows (a closed form with
    gamma^-k would overflow for long sequences)."""
    if gamma == 1.0:
        return x.flip(-1).cumsum(-1).flip(-1)
    out = torch.empty_like(x)
    running = torch.zeros_like(x[:, 0])
    for k in range(x.shape[-1] - 1, -1, -1):
        running = x[:, k] + gamma * running
        out[:, k] = running
    return out


def detach_all(metrics: dict) -> dict:
    """Metric dicts hold floats or detached 0-d tensors; no device sync happens here (call float() to log)."""
    return {k: (v.detach() if isinstance(v, Tensor) else v) for k, v in metrics.items()}
