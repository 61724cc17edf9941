"""The embedded engine's prefix cache, shared by every request: keys/values kept in blocks of `BLOCK` tokens, each
keyed by a hash of the whole token prefix it ends (vLLM's automatic prefix caching), so that a request reuses the
longest cached prefix whichever session computed it: a multi-turn agent prefills only its new tokens, and every
rollout of a harness its own part after the shared system prompt and tools.

Design notes and decisions: docs/internals.md, section `molt/engine/prefix_cache.py`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

BLOCK = 16  # tokens a block (vLLM's default block size)


@dataclass(slots=True)
class Prefix:
    """A lookup's find: the keys/values of a context's first n tokens."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values) [1, kv_heads, n, head_dim]
    routes: torch.Tensor | None = None  # MoE: the experts each token was routed to [n, layers, k]


@dataclass(slots=True)
class Block:
    kv: torch.Tensor  # [2 x layers, kv_heads, BLOCK, head_dim]: each layer's keys, then its values
    routes: torch.Tensor | None  # MoE [BLOCK, layers, k]
    nbytes: int


def block_keys(tokens: list[int], adapter: str = "") -> list[int]:
    """The key of each whole block of `tokens`: a hash of its parent's key and its own tokens, hence of the whole
    prefix it ends (a partial last block has none), and of the LoRA adapter that computed it."""
    keys, key = [], hash(adapter)
    for i in range(BLOCK, len(tokens) + 1, BLOCK):
        key = hash((key, *tokens[i - BLOCK : i]))
        keys.append(key)
    return keys


class PrefixCache:
    def __init__(self, budget_mb: float):
        if budget_mb < 0:
            raise ValueError(f"prefix_cache_mb must be >= 0 (0 turns the cache off), got {budget_mb}")
        self.budget = int(budget_mb * 2**20)
        self.blocks: OrderedDict[int, Block] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.reused_tokens = 0  # over the engine's life: how many prompt tokens were not prefilled again

    def lookup(self, context: list[int], adapter: str = "") -> tuple[list[int], int]:
        """The keys of `context`'s whole blocks, never its last token (whose logits are needed), and how many of
        them lead the context in the cache; changes nothing (`take` does)."""
        keys = block_keys(context[:-1], adapter) if self.budget else []
        return keys, next((i for i, key in enumerate(keys) if key not in self.blocks), len(keys))

    def take(self, keys: list[int]) -> Prefix | None:
        """The keys/values of these cached blocks, the most recently used now."""
        if not keys:
            return None
        self._touch(keys)
        blocks = [self.blocks[key] for key in keys]
        kv = torch.cat([b.kv for b in blocks], 2)
        self.reused_tokens += len(keys) * BLOCK
        routes = None if blocks[0].routes is None else torch.cat([b.routes for b in blocks])
        return Prefix([(kv[i : i + 1], kv[i + 1 : i + 2]) for i in range(0, len(kv), 2)], routes)

    def store(
        self,
        tokens: list[int],
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        routes: torch.Tensor | None = None,
        adapter: str = "",
    ) -> None:
        """Keep the whole blocks of `tokens` that the cache lacks, from their keys/values (per layer [1, kv_heads,
        len(tokens), head_dim]) and MoE routes [len(tokens), layers, k]; the least recently used blocks go."""
        assert all(k.shape[-2] == len(tokens) for k, _ in layers), "keys/values must cover exactly `tokens`"
        keys = block_keys(tokens, adapter)
        new = [i for i, key in enumerate(keys) if key not in self.blocks]
        # one copy of the columns from the first new block on, then a clone of each new block (its own memory)
        if new:
            start = new[0] * BLOCK
            flat = torch.stack([t[0, :, start : len(keys) * BLOCK] for pair in layers for t in pair])
        for i in new:
            kv = flat[:, :, i * BLOCK - start : (i + 1) * BLOCK - start].clone()
            part = None if routes is None else routes[i * BLOCK : (i + 1) * BLOCK].clone()
            self.blocks[keys[i]] = Block(kv, part, kv.nbytes + (0 if part is None else part.nbytes))
            self.nbytes += self.blocks[keys[i]].nbytes
        self._touch(keys)
        while self.nbytes > self.budget:
            self.nbytes -= self.blocks.popitem(last=False)[1].nbytes

    def _touch(self, keys: list[int]) -> None:
        for key in reversed(keys):  # a chain's last block ends up oldest: it is evicted before its parents
            self.blocks.move_to_end(key)

    def refit(self) -> None:
        """New weights were loaded: keys/values computed with the old ones are wrong, every block goes."""
        self.blocks.clear()
        self.nbytes = 0

    def stats(self) -> dict[str, int]:
        return {"blocks": len(self.blocks), "bytes": self.nbytes, "reused_tokens": self.reused_tokens}


def common_prefix(a: list[int], b: list[int], block: int = 512) -> int:
    """Length of the longest common prefix of two token lists: list slices compare in C block by block, and
    only the first differing block is walked in Python (a 32K-token history costs microseconds, not a loop)."""
    n, i = min(len(a), len(b)), 0
    while i < n and a[i : min(i + block, n)] == b[i : min(i + block, n)]:
        i += block
    return n if i >= n else next(j for j in range(i, n) if a[j] != b[j])


def copies_of(new: list[Any]) -> dict[Any, list[Any]]:
    """Leader -> the new requests (itself first) that share its prefill: the same context (`prompt + tokens`) and
    LoRA adapter, no images. A GRPO group's samples arrive together with one prompt; they prefill it once, and
    `molt.engine.hf` copies the leader's keys/values and logits to the others."""
    copies: dict[Any, list[Any]] = {}
    leaders: dict[tuple[int, ...], Any] = {}
    for r in new:
        leader = r if r.images else leaders.setdefault((r.adapter, *r.prompt, *r.tokens), r)
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


def left_pad(t: torch.Tensor, length: int) -> torch.Tensor:
    """`t` [..., n, head_dim] with `length - n` zero columns in front; itself (no copy) when none are missing."""
    return t if t.shape[-2] == length else F.pad(t, (0, 0, length - t.shape[-2], 0))


def prefill_inputs(
    contexts: list[list[int]], reused: list[tuple[Prefix | None, int]], pad_id: int, cache: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input ids [rows, S], attention mask [rows, C + S] and positions [rows, S] of one prefill group; fills the
    empty DynamicCache `cache` with the reused keys/values [rows, kv_heads, C, head_dim] (the layout of the
    module docstring). Without reuse (C = 0) this is a plain left-padded prefill."""
    width = max(n for _, n in reused)
    suffixes = [ctx[n:] for ctx, (_, n) in zip(contexts, reused)]
    length = max(map(len, suffixes))
    ids = torch.full((len(contexts), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(contexts), width + length), dtype=torch.long)
    for i, (suffix, (_, n)) in enumerate(zip(suffixes, reused)):
        ids[i, length - len(suffix) :] = torch.tensor(suffix)
        mask[i, width - n : width] = 1
        mask[i, width + length - len(suffix) :] = 1
    if width:
        template = next(entry for entry, n in reused if n)  # rows without reuse: its tensors cut to 0 columns
        for layer in range(len(template.layers)):
            keys_values = []
            for kv in (0, 1):
                parts = [
                    left_pad((entry if n else template).layers[layer][kv][..., :n, :], width)
                    for entry, n in reused
                ]
                keys_values.append(parts[0] if len(parts) == 1 else torch.cat(parts))
            cache.update(*keys_values, layer)  # (it copies them)
    positions = (mask.cumsum(1) - 1).clamp(min=0)[:, width:]
    return ids, mask, positions
