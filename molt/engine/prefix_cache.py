"""The embedded engine's session prefix cache: a multi-turn agent resends its whole history every turn, and the
engine keeps the keys/values of the session's last turns (its conversation and its side requests) so that the next
turn prefills only its new tokens.

Design notes and decisions: docs/internals.md, section `molt/engine/prefix_cache.py`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(slots=True, eq=False)  # entries are told apart by identity
class Prefix:
    tokens: list[int]  # the token ids the keys/values cover
    # per layer (keys, values) [1, kv_heads, len(tokens), head_dim]
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    nbytes: int
    routes: Any = None  # MoE: the experts each token was routed to [len(tokens), layers, k] (molt.engine.hf)


# Entries kept per session: its main conversation plus the side requests harnesses send on the same session (a
# title, a summary, a sub-agent with its own system prompt), so that one does not evict the other's keys/values.
MAX_ENTRIES_PER_SESSION = 4


class PrefixCache:
    def __init__(self, budget_mb: float):
        if budget_mb < 0:
            raise ValueError(f"prefix_cache_mb must be >= 0 (0 turns the cache off), got {budget_mb}")
        self.budget = int(budget_mb * 2**20)
        # sessions in LRU order (oldest first); a session's entries least recently stored or used first
        self.entries: OrderedDict[str, list[Prefix]] = OrderedDict()
        self.nbytes = 0
        self.reused_tokens = 0  # over the engine's life: how many prompt tokens were not prefilled again

    def lookup(self, session_id: str | None, context: list[int]) -> tuple[Prefix | None, int]:
        """The session's entry sharing the longest prefix with `context` and how many leading tokens of `context`
        it covers (0: no reuse), never the last one (its logits are needed)."""
        entries = self.entries.get(session_id) if session_id is not None else None
        if not entries:
            return None, 0
        n, entry = max(
            ((min(common_prefix(e.tokens, context), len(context) - 1), e) for e in entries),
            key=lambda pair: pair[0],
        )
        if n:
            self.entries.move_to_end(session_id)
            entries.remove(entry)
            entries.append(entry)
            self.reused_tokens += n
        return entry, n

    def store(
        self,
        session_id: str,
        tokens: list[int],
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        routes: list[torch.Tensor] | None = None,
    ) -> None:
        """Keep a finished request's keys/values; the session's entries it extends (its earlier turns) go."""
        assert all(k.shape[-2] == len(tokens) for k, _ in layers), "keys/values must cover exactly `tokens`"
        nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
        if nbytes > self.budget:
            return
        entries = self.entries.pop(session_id, [])
        kept = [e for e in entries if common_prefix(e.tokens, tokens) < len(e.tokens)]
        # the most recent ones, with room for this
        kept = kept[max(0, len(kept) + 1 - MAX_ENTRIES_PER_SESSION) :]
        self.nbytes += nbytes - sum(e.nbytes for e in entries if e not in kept)
        entry = Prefix(tokens, layers, nbytes, torch.cat(routes) if routes else None)
        self.entries[session_id] = kept + [entry]
        # least recently used sessions first; never the new entry (it fits alone)
        while self.nbytes > self.budget:
            oldest = next(iter(self.entries))
            self._remove(oldest, self.entries[oldest][0])

    def _remove(self, session_id: str, entry: Prefix) -> None:
        entries = self.entries[session_id]
        entries.remove(entry)
        self.nbytes -= entry.nbytes
        if not entries:
            del self.entries[session_id]

    def refit(self) -> None:
        """New weights were loaded: keys/values computed with the old ones are wrong, every entry goes."""
        self.entries.clear()
        self.nbytes = 0

    def stats(self) -> dict[str, int]:
        return {
            "entries": sum(map(len, self.entries.values())),
            "bytes": self.nbytes,
            "reused_tokens": self.reused_tokens,
        }


def common_prefix(a: list[int], b: list[int], block: int = 512) -> int:
    """Length of the longest common prefix of two token lists: list slices compare in C block by block, and
    only the first differing block is walked in Python (a 32K-token history costs microseconds, not a loop)."""
    n, i = min(len(a), len(b)), 0
    while i < n and a[i : min(i + block, n)] == b[i : min(i + block, n)]:
        i += block
    return n if i >= n else next(j for j in range(i, n) if a[j] != b[j])


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
