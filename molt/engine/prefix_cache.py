"""The embedded engine's session prefix cache: a multi-turn agent resends its whole history every turn, and the
engine keeps the keys/values of the session's last turn so that the next turn prefills only its new tokens.

Design notes and decisions: docs/internals.md, section `molt/engine/prefix_cache.py`.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class Prefix:
    tokens: list[int]  # the token ids the keys/values cover
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values) [1, kv_heads, len(tokens), head_dim]
    version: int  # policy version of the oldest keys/values
    nbytes: int
    routes: Any = None  # MoE: the experts each token was routed to [len(tokens), layers, k] (molt.engine.hf)


class PrefixCache:
    def __init__(self, budget_mb: float, stale: bool = False):
        if budget_mb < 0:
            raise ValueError(f"prefix_cache_mb must be >= 0 (0 turns the cache off), got {budget_mb}")
        self.budget = int(budget_mb * 2**20)
        self.stale = stale
        self.entries: OrderedDict[str, Prefix] = OrderedDict()  # LRU order: oldest first
        self.nbytes = 0
        self.reused_tokens = 0  # over the engine's life: how many prompt tokens were not prefilled again

    def lookup(self, session_id: str | None, context: list[int]) -> tuple[Prefix | None, int]:
        """The session's entry and how many leading tokens of `context` it covers (0: no reuse)."""
        entry = self.entries.get(session_id) if session_id is not None else None
        if entry is None:
            return None, 0
        limit = min(len(entry.tokens), len(context) - 1)
        n = next((i for i in range(limit) if entry.tokens[i] != context[i]), limit)
        if n:
            self.entries.move_to_end(session_id)
            self.reused_tokens += n
        return entry, n

    def store(self, session_id: str, tokens: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]],
              version: int, routes: list[torch.Tensor] | None = None) -> None:
        assert all(k.shape[-2] == len(tokens) for k, _ in layers), "keys/values must cover exactly `tokens`"
        self.drop(session_id)
        nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
        if nbytes > self.budget:
            return
        while self.nbytes + nbytes > self.budget:
            self.drop(next(iter(self.entries)))
        self.entries[session_id] = Prefix(tokens, layers, version, nbytes, torch.cat(routes) if routes else None)
        self.nbytes += nbytes

    def drop(self, session_id: str) -> None:
        entry = self.entries.pop(session_id, None)
        if entry is not None:
            self.nbytes -= entry.nbytes

    def refit(self) -> None:
        """New weights were loaded: forget every entry unless stale prefixes are allowed."""
        if not self.stale:
            self.entries.clear()
            self.nbytes = 0

    def stats(self) -> dict[str, int]:
        return {"entries": len(self.entries), "bytes": self.nbytes, "reused_tokens": self.reused_tokens}


def copies_of(new: list[Any], reused: dict[Any, tuple[Prefix | None, int]]) -> dict[Any, list[Any]]:
    """Leader -> the new requests (itself first) that share its prefill: the same context (`prompt + tokens`), no
    images and nothing from the prefix cache. A GRPO group's samples arrive together with one prompt; they
    prefill it once, and `molt.engine.hf` copies the leader's keys/values and logits to the others."""
    copies: dict[Any, list[Any]] = {}
    leaders: dict[tuple[int, ...], Any] = {}
    for r in new:
        leader = r if r.images or reused[r][1] else leaders.setdefault(tuple(r.prompt + r.tokens), r)
        copies.setdefault(leader, []).append(r)
    return copies


def prefill_groups(new: list[Any], work: dict[Any, int], budget: int) -> Iterable[list[Any]]:
    """Split new requests (least work first, less padding) into prefill groups of at most `budget` tokens
    (rows x the longest work), work being the tokens a request prefills (its context minus what this cache holds).
    A request over the budget alone is one group, which `molt.engine.hf` prefills in chunks."""
    group: list[Any] = []
    for req in sorted(new, key=work.__getitem__):
        if group and (len(group) + 1) * work[req] > budget:
            yield group
            group = []
        group.append(req)
    if group:
        yield group


def left_pad(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - t.shape[dim]
    if missing == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [missing, 0]
    return F.pad(t, pad)


def prefill_inputs(contexts: list[list[int]], reused: list[tuple[Prefix | None, int]], pad_id: int,
                   cache: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input ids [rows, S], attention mask [rows, C + S] and positions [rows, S] of one prefill group; fills the
    empty DynamicCache `cache` with the reused keys/values [rows, kv_heads, C, head_dim] (the layout of the
    module docstring). Without reuse (C = 0) this is a plain left-padded prefill."""
    width = max(n for _, n in reused)
    suffixes = [ctx[n:] for ctx, (_, n) in zip(contexts, reused)]
    length = max(map(len, suffixes))
    ids = torch.full((len(contexts), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(contexts), width + length), dtype=torch.long)
    for i, (suffix, (_, n)) in enumerate(zip(suffixes, reused)):
        ids[i, length - len(suffix):] = torch.tensor(suffix)
        mask[i, width - n: width] = 1
        mask[i, width + length - len(suffix):] = 1
    if width:
        template = next(entry for entry, n in reused if n)  # rows without reuse: its tensors cut to 0 columns
        for layer in range(len(template.layers)):
            keys, values = ([left_pad((entry if n else template).layers[layer][kv][..., :n, :], width, -2)
                             for entry, n in reused] for kv in (0, 1))
            cache.update(torch.cat(keys), torch.cat(values), layer)
    positions = (mask.cumsum(1) - 1).clamp(min=0)[:, width:]
    return ids, mask, positions

