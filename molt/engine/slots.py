"""The embedded engine's running batch in preallocated key/value slots, and its decode step under CUDA graphs.

Design notes and decisions: docs/internals.md, section `molt/engine/slots.py`.
"""

from __future__ import annotations

import inspect
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from molt.modeling import mm_f32


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << max(n - 1, 0).bit_length())


class Slots:
    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_rows: int,
        max_columns: int,
    ):
        self.shape, self.dtype, self.device = (layers, kv_heads, head_dim), dtype, device
        self.max_rows, self.max_columns = max_rows, max_columns
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.rows = self.width = 0  # rows in use; columns in use (every row ends at width - 1)
        self.moved = 0  # storage reallocations (a graph decoder captures again after one)

    def reset(self) -> None:
        """Empty the batch (storage kept)."""
        self.mask[: self.rows].zero_()
        self.rows = self.width = 0

    def reserve(self, rows: int, columns: int) -> None:
        """Capacity for `rows` x `columns` (powers of two, capped), keeping the content."""
        have_r, have_c = self.mask.shape
        if rows <= have_r and columns <= have_c:
            return
        if rows > self.max_rows or columns > self.max_columns:
            raise RuntimeError(f"slots: {rows} x {columns} exceeds {self.max_rows} x {self.max_columns}")
        r = min(max(_pow2(rows), have_r), self.max_rows)
        c = min(max(_pow2(columns, 64), have_c), self.max_columns)
        layers, heads, dim = self.shape
        kv = []
        for i in range(layers):
            pair = tuple(
                torch.zeros(r, heads, c, dim, dtype=self.dtype, device=self.device) for _ in range(2)
            )
            for new, old in zip(pair, self.kv[i] if self.kv else ()):
                new[: self.rows, :, : self.width] = old[: self.rows, :, : self.width]
            kv.append(pair)
        mask = torch.zeros(r, c, dtype=torch.long, device=self.device)
        mask[: self.rows, : self.width] = self.mask[: self.rows, : self.width]
        self.kv, self.mask, self.moved = kv, mask, self.moved + 1

    def _shift(self, by: int) -> None:
        """Move the rows' columns right (by > 0, making room in front) or left (by < 0, dropping leading ones)."""
        n, w = self.rows, self.width
        if by > 0:
            src, dst, clear = slice(0, w), slice(by, w + by), slice(0, by)
        else:
            src, dst, clear = slice(-by, w), slice(0, w + by), slice(w + by, w)
        for pair in self.kv:
            for t in pair:
                t[:n, :, dst] = t[:n, :, src].clone()
        self.mask[:n, dst] = self.mask[:n, src].clone()
        self.mask[:n, clear] = 0
        self.width = w + by

    def merge(self, layers: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> None:
        """Append a prefilled group: per layer (keys, values) [g, kv_heads, m, head_dim] and its mask [g, m]. Each
        row's tokens are gathered to the right first, closing the gap a prefill from a reused prefix leaves
        between prefix and suffix, so that every row is contiguous and the width stays within the context."""
        g = mask.shape[0]
        m = int(mask.sum(1).max())
        if bool((mask[:, 1:] >= mask[:, :-1]).all()):  # contiguous already (a turn over its prefix): a view
            mask, layers = mask[:, -m:], [(k[:, :, -m:], v[:, :, -m:]) for k, v in layers]
        else:
            order = mask.argsort(dim=1, stable=True)[:, -m:]  # padding first, then the tokens in their order
            at = order[:, None, :, None].expand(g, layers[0][0].shape[1], m, layers[0][0].shape[3])
            mask, layers = mask.gather(1, order), [(k.gather(2, at), v.gather(2, at)) for k, v in layers]
        if m > self.width:
            self.reserve(self.rows, m)
            if self.rows:
                self._shift(m - self.width)
            self.width = m
        self.reserve(self.rows + g, self.width)
        rows, cols = slice(self.rows, self.rows + g), slice(self.width - m, self.width)
        for (keys, values), (k, v) in zip(self.kv, layers):
            keys[rows, :, cols], values[rows, :, cols] = k, v
            keys[rows, :, : self.width - m] = 0  # masked, but a previous occupant's inf/nan would still leak
            values[rows, :, : self.width - m] = 0
        self.mask[rows] = 0
        self.mask[rows, cols] = mask
        self.rows += g

    def keep(self, rows: list[int]) -> list[int]:
        """Keep these rows; returns which old row each slot 0..len(rows)-1 now holds. Kept rows past the new end
        move into the holes: a copy of the moved rows only, where gathering every row would copy the whole batch
        at each departure."""
        n = len(rows)
        kept = set(rows)
        holes = [i for i in range(n) if i not in kept]
        movers = [i for i in rows if i >= n]
        order = list(range(n))
        if holes:
            to, at = (torch.tensor(x, device=self.device) for x in (holes, movers))
            for pair in self.kv:
                for t in pair:
                    t[to, :, : self.width] = t[at, :, : self.width]
            self.mask[to, : self.width] = self.mask[at, : self.width]
            for hole, mover in zip(holes, movers):
                order[hole] = mover
        self.mask[n : self.rows] = 0
        self.rows = n
        if n:
            self._trim(force=False)
        else:
            self.width = 0
        return order

    def _trim(self, force: bool) -> None:
        """Drop the leading columns no row uses: when forced (no room for the next column) or when that shrinks
        the attended width's power of two (a shift copies every row, so not on every departure)."""
        start = int(self.mask[: self.rows, : self.width].any(0).nonzero()[0])
        if start and (force or _pow2(self.width - start + 1, 64) < _pow2(self.width + 1, 64)):
            self._shift(-start)

    def advance(self) -> torch.Tensor:
        """Open column `width` for every row; returns each row's position there [rows, 1]."""
        if self.width + 1 > self.max_columns:
            self._trim(force=True)
        self.reserve(self.rows, self.width + 1)
        self.mask[: self.rows, self.width] = 1
        return self.mask[: self.rows, : self.width + 1].sum(1, keepdim=True) - 1

    def view(self, rows: int, columns: int, column: torch.Tensor) -> _View:
        return _View(self.kv, rows, columns, column)

    def bias(self, rows: int, columns: int, dtype: torch.dtype) -> torch.Tensor:
        """The additive attention mask [rows, 1, 1, columns] of a decode step (0 attend, dtype's min not)."""
        keep = self.mask[:rows, None, None, :columns].bool()
        return torch.zeros(keep.shape, dtype=dtype, device=self.device).masked_fill_(
            ~keep, torch.finfo(dtype).min
        )

    def row(self, i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Row i's keys/values without its padding columns, views [1, kv_heads, n, head_dim] (the prefix cache
        copies the blocks it lacks): a row's tokens are its last columns (`merge` makes them contiguous)."""
        cols = slice(self.width - int(self.mask[i, : self.width].sum()), self.width)
        return [(k[i : i + 1, :, cols], v[i : i + 1, :, cols]) for k, v in self.kv]


def prefill_bias(mask: torch.Tensor, queries: int, dtype: torch.dtype | None) -> torch.Tensor:
    """The additive attention mask [rows, 1, queries, columns] of a prefill chunk over a cached context, its
    queries the last of `mask`'s columns [rows, columns] (1 a token, 0 padding): zeros with the causal triangle
    of the chunk's own columns, written once per forward. transformers would build a boolean mask over the
    whole context in four passes and each layer's SDPA turn it into this one again: at 30K tokens of context
    that cost more than the attention itself (docs/internals.md). A chunk without a context keeps its 2D mask,
    so that transformers can still skip the mask and use the causal kernel; so does a model whose mask
    transformers builds its own way (dtype None: vision models, around their images)."""
    rows, width = mask.shape
    if width == queries or dtype is None:
        return mask
    low = torch.finfo(dtype).min
    bias = torch.zeros(rows, 1, queries, width, dtype=dtype, device=mask.device)
    causal = torch.full((queries, queries), low, dtype=dtype, device=mask.device).triu_(1)
    bias[..., width - queries :] = causal
    if not bool(mask.all()):
        bias.masked_fill_(mask[:, None, None, :] == 0, low)
    return bias


class _View:
    """What the model's attention layers see as the cache: `update` writes the new token's keys/values at the
    column tensor `column` of the first `rows` slots and returns their first `columns` columns."""

    def __init__(
        self, kv: list[tuple[torch.Tensor, torch.Tensor]], rows: int, columns: int, column: torch.Tensor
    ):
        self.kv, self.rows, self.columns, self.column = kv, rows, columns, column

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer: int, *args: Any, **kwargs: Any):
        k, v = self.kv[layer]
        k[: self.rows].index_copy_(2, self.column, keys)
        v[: self.rows].index_copy_(2, self.column, values)
        return k[: self.rows, :, : self.columns], v[: self.rows, :, : self.columns]


def grouped_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' `sdpa` attention, except for a decode step (one query per row, a mask shared by the heads):
    with a mask, transformers copies every key/value head once per query head it serves (SDPA's own GQA would
    fall back to its math kernel), a copy of the whole cache per layer and step. Viewing each key/value head's
    query heads as its queries computes the same attention without the copy (docs/internals.md). On a CPU a
    masked prefill skips the copy too: its flash kernel takes SDPA's GQA flag with a mask (about a tenth of a
    300-token turn over 30K cached tokens)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows, heads, n, dim = query.shape
    groups = heads // key.shape[1]
    if (
        n != 1
        and query.device.type != "cpu"
        or groups == 1
        or attention_mask is None
        or attention_mask.shape[1] != 1
        or kwargs.get("position_bias") is not None
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    # a prefill on a CPU, whose flash kernel takes grouped heads with a mask (CUDA's falls back to math)
    if n != 1:
        out = F.scaled_dot_product_attention(
            query, key, value, attention_mask, scale=kwargs.get("scaling"), enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None
    out = F.scaled_dot_product_attention(
        query.reshape(rows, key.shape[1], groups, dim),
        key,
        value,
        attn_mask=attention_mask,
        scale=kwargs.get("scaling"),
    )
    # head h reads key/value head h // groups, as repeat_kv has it
    return out.reshape(rows, 1, heads, -1), None


def use_grouped_attention(model: Any) -> bool:
    """Route a text model's `sdpa` attention through `grouped_attention` (prefill masks stay sdpa's), unless
    the model's own code asks for the name "sdpa" (Falcon picks its eager branch by it, some sparse-attention
    models their masks): those keep sdpa. Whether it did."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    source = inspect.getsource(sys.modules[type(model).__module__])
    if model.config._attn_implementation != "sdpa" or '"sdpa"' in source or "'sdpa'" in source:
        return False
    AttentionInterface.register("molt_sdpa", grouped_attention)
    AttentionMaskInterface.register("molt_sdpa", sdpa_mask)
    model.config._attn_implementation = "molt_sdpa"
    return True


def fp32_logits(model: Any) -> None:
    """A bf16 model's output head returns its fp32 accumulator (`molt.modeling.mm_f32`), as the trainer's log-prob
    head does: logits of 20 rounded to bf16 move by up to 0.04, and the behavior log-probs with them, a gap
    the trainer's own log-probs would not share. A captured graph's output [rows, vocab] is then fp32 too
    (about 155 MB at 256 rows of Qwen's vocabulary, per graph of that row count)."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.weight.dtype == torch.float32:
        return

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = mm_f32(x.reshape(-1, x.shape[-1]), head.weight.T)
        return (out if head.bias is None else out + head.bias.float()).view(*x.shape[:-1], -1)

    head.forward = forward


def engine_device(device: str) -> torch.device:
    """The engine's device with its index (its worker thread makes it current: streams and captures go to the
    current device). On CUDA, cuDNN attention is turned off: it builds a plan for every new shape (1.7 ms of
    host time per call on an H200), which each eager prefill of a new length would pay, where flash and
    memory-efficient attention plan nothing. The flag is the process's; an engine has a process of its own
    (molt.engine.process, or the rollout worker's)."""
    device = torch.device(device)
    if device.type != "cuda":
        return device
    torch.backends.cuda.enable_cudnn_sdp(False)
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


class GraphDecoder:
    """Decode forwards on padded power-of-two shapes from static buffers; captured as CUDA graphs on CUDA."""

    def __init__(self, model: Any, slots: Slots, cache_kw: str, capture: bool):
        self.model, self.slots, self.cache_kw, self.capture = model, slots, cache_kw, capture
        self.graphs: dict[tuple[int, int], Any] = {}
        self.captures, self.capture_s = 0, 0.0  # over the engine's life (a refit adds none)
        self._moved = -1
        self._pool = self._stream = None

    def _buffers(self) -> None:
        """(Re)allocate the static inputs for the slots' current storage; captured graphs refer to the old one."""
        rows, columns = self.slots.mask.shape
        device = self.slots.device
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)
        self.bias = torch.zeros(rows, 1, 1, columns, dtype=self.slots.dtype, device=device)
        self.graphs.clear()
        self._pool = None  # a fresh pool: the old one dies with its graphs
        self._moved = self.slots.moved

    def _forward(self, rows: int, columns: int) -> torch.Tensor:
        out = self.model(
            input_ids=self.ids[:rows],
            attention_mask=self.bias[:rows, :, :, :columns],
            position_ids=self.positions[:rows],
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_kw: self.slots.view(rows, columns, self.column)},
        )
        return out.logits[:, -1]

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] of the running rows' next token; `Slots.advance` has opened column `width`."""
        slots = self.slots
        n, width = slots.rows, slots.width
        rows = min(_pow2(n), slots.mask.shape[0])
        columns = min(_pow2(width + 1, 64), slots.mask.shape[1])
        if self._moved != slots.moved:
            self._buffers()
        self.ids[:n] = ids
        self.positions[:n] = positions
        self.column.fill_(width)
        self.bias[:rows, :, :, :columns] = slots.bias(rows, columns, slots.dtype)
        if not self.capture:
            return self._forward(rows, columns)[:n]
        key = (rows, columns)
        if key not in self.graphs:
            self.graphs[key] = self._capture(rows, columns)
        graph, logits = self.graphs[key]
        graph.replay()
        return logits[:n]

    def _capture(self, rows: int, columns: int) -> tuple[Any, torch.Tensor]:
        """Warm up, then capture, on one side stream kept for the engine's life: its first matmuls allocate
        cuBLAS's workspace there, outside the graph pool. The stream is entered around the capture, so a failed
        capture leaves the worker on its usual stream. Warm-up writes land in column `width`, which the replay
        that follows overwrites with the same values."""
        start = time.perf_counter()
        self._stream = self._stream or torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for _ in range(2):
                self._forward(rows, columns)
            self._pool = self._pool or torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # thread_local: a trainer sharing the GPU from another thread may launch work while this one captures
            with torch.cuda.graph(
                graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"
            ):
                logits = self._forward(rows, columns)
        torch.cuda.current_stream().wait_stream(self._stream)
        self.captures += 1
        self.capture_s += time.perf_counter() - start
        return graph, logits
