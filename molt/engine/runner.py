"""The embedded engine's model runner: the model, the running batch's key/value slots, the CUDA-graph decoder
and the prefix cache; it runs the forwards the scheduler (`molt.engine.scheduler`) plans.

Design notes and decisions: docs/internals.md, section `molt/engine/hf.py`.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import torch

from molt.engine.prefix_cache import (
    BLOCK,
    PrefixCache,
    common_prefix,
    copies_of,
    prefill_groups,
    prefill_inputs,
)
from molt.engine.request import Request
from molt.engine.scheduler import Prefill
from molt.engine.slots import (
    GraphDecoder,
    Slots,
    engine_device,
    fp32_logits,
    prefill_bias,
    use_grouped_attention,
)
from molt.modeling import ModelSpec, rope_positions
from molt.types import FinishReason, join_inputs

# A new request waits for a prefill in flight that computes at least this many of its tokens, and half of them: a
# shorter prefill of its own costs less than the steps it would wait.
DEFER_TOKENS = 256


class ModelRunner:
    """Only the engine's worker thread calls it (the asyncio side reads `prefixes.stats()`)."""

    def __init__(
        self,
        model_path: str,
        *,
        name: str,
        max_batch_size: int,
        max_prefill_tokens: int,
        dtype: str = "float32",
        device: str = "cpu",
        prefix_cache_mb: float = 1024,
        cuda_graphs: bool = True,
        lora: dict[str, Any] | None = None,
        adapters: list[str] | None = None,
    ):
        import transformers as tf

        self.name, self.device = name, engine_device(device)
        if (
            dtype == "auto"
        ):  # a CPU with avx512_bf16 (or AMX) computes bf16 natively: faster (docs/benchmarks.md)
            native = self.device.type == "cuda" or torch.cpu._is_avx512_bf16_supported()
            dtype = "bfloat16" if native else "float32"
        if not hasattr(torch, dtype) or not isinstance(getattr(torch, dtype), torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r} (use auto, float32 or bfloat16)")
        self.spec = spec = ModelSpec.from_pretrained(model_path)
        self.banned = list(spec.banned)  # never sampled (docs/internals.md)
        self.model = spec.auto_class.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(self.device)
        # the trainer's adapters (PEFT LoraConfig arguments), PEFT's one or one per role, zero until a refit loads
        # them by name; with several, each row of a forward runs its own (PEFT's mixed batches, `adapter_rows`)
        self.adapters, self.adapter_rows = adapters or [], []
        for adapter in self.adapters or (["default"] if lora else []):
            from peft import LoraConfig, inject_adapter_in_model

            inject_adapter_in_model(LoraConfig(**lora), self.model, adapter_name=adapter)
        if self.adapters:
            from peft.tuners.lora import LoraLayer

            for m in self.model.modules():
                if isinstance(m, LoraLayer):
                    m.register_forward_pre_hook(self._name_rows, with_kwargs=True)
        self.model.eval()
        if not spec.vision:
            use_grouped_attention(self.model)
        fp32_logits(self.model)
        self.max_batch_size, self.max_prefill_tokens = max_batch_size, max_prefill_tokens
        self._new_cache = lambda: tf.DynamicCache(config=self.model.config.get_text_config())
        layer_types = {type(layer).__name__ for layer in self._new_cache().layers}
        if layer_types != {"DynamicLayer"}:  # sliding-window layers cannot be left-padded and merged
            raise ValueError(f"HFEngine supports full-attention caches only, got {sorted(layer_types)}")
        # MoE: each router's top-k experts in this forward, in layer order
        self._routes: list[torch.Tensor] = []
        routers = [m for m in self.model.modules() if type(m).__name__.endswith("TopKRouter")]
        for router in routers:
            router.register_forward_hook(lambda _m, _a, out: self._routes.append(out[2]))
        self._route_dtype = torch.uint8 if all(r.weight.shape[0] <= 256 for r in routers) else torch.int16
        # CUDA graphs for the decode step (molt.engine.slots), not where a step needs Python (route hooks, images);
        # the decoder itself once the slots exist
        python_steps = routers or spec.vision or spec.dynamic_rope or self.adapters
        self.graphs: GraphDecoder | bool = cuda_graphs and self.device.type == "cuda" and not python_steps
        self.graph_error: str | None = None  # why graphs were given up, if they were (`_graph_decode`)
        self.prefixes = PrefixCache(prefix_cache_mb)
        self.inflight: dict[Request, list[int]] = {}  # prefills in progress, leader -> context (`plan`)
        self.slots: Slots | None = None  # row i holds the scheduler's running[i] (made at the first prefill)

    def _name_rows(self, _layer: Any, args: Any, kwargs: dict) -> tuple[Any, dict]:
        return args, {**kwargs, "adapter_names": self.adapter_rows}

    def decode(self, rows: list[Request]) -> torch.Tensor:
        """Logits [rows, vocab] of the running batch's next tokens; each row's last token enters its slot."""
        slots, self.adapter_rows = self.slots, [r.adapter for r in rows]
        positions = slots.advance()
        if any(r.rope_offset for r in rows):
            positions = positions + torch.tensor([[r.rope_offset] for r in rows], device=self.device)
        ids = torch.tensor([[r.tokens[-1]] for r in rows], device=self.device)
        logits, routes = self._graph_decode(ids, positions), None
        if logits is None:
            n, columns = slots.rows, slots.width + 1
            column = torch.tensor([slots.width], device=self.device)
            logits, routes = self._forward(
                ids, slots.bias(n, columns, self.model.dtype), positions, slots.view(n, columns, column)
            )
        slots.width += 1
        for i, r in enumerate(rows):
            r.route(len(r.prompt) + len(r.tokens) - 1, None if routes is None else routes[i])
        return logits

    def plan(self, new: list[Request]) -> tuple[list[Prefill], list[Request]]:
        """New requests as prefills, and those that wait for a prefill in flight computing most of their context
        (they take its blocks once it ends, `DEFER_TOKENS`): each takes the longest prefix the cache holds, copies
        of one context share a row (`copies_of`), groups hold at most the token budget (`prefill_groups`)."""
        copies, reused, deferred = copies_of(new), {}, []
        for r in list(copies):
            context = r.prompt + r.tokens
            keys, n = ([], 0) if r.images else self.prefixes.lookup(context, r.adapter)
            cached = n * BLOCK
            ahead = [c for q, c in self.inflight.items() if q.adapter == r.adapter]
            shared = max((common_prefix(context, c) for c in ahead), default=0) - cached
            if shared >= max(DEFER_TOKENS, (len(context) - cached) / 2):
                deferred += copies.pop(r)
                continue
            if keys:  # a cache, no images: what it computes now, later arrivals may wait for
                self.inflight[r] = context
            prefix = self.prefixes.take(keys[:n])
            reused.update((c, (prefix, cached)) for c in copies[r])
        work = {r: len(r.prompt) + len(r.tokens) - reused[r][1] for r in copies}
        jobs = []
        for group in prefill_groups(list(copies), work, self.max_prefill_tokens):
            cache = self._new_cache()
            contexts = [r.prompt + r.tokens for r in group]
            inputs = prefill_inputs(contexts, [reused[r] for r in group], self.spec.pad_token_id, cache)
            ids, mask, positions = (t.to(self.device) for t in inputs)
            images = join_inputs(*(r.images for r in group))
            positions, offsets = rope_positions(self.model, ids, mask, positions, images)
            for r, offset in zip(group, offsets):
                for c in copies[r]:
                    c.rope_offset = offset
            images = {
                k: v.to(self.device, self.model.dtype) if v.is_floating_point() else v.to(self.device)
                for k, v in (images or {}).items()
            }
            state = SimpleNamespace(
                group=group,
                copies=copies,
                reused=reused,
                cache=cache,
                ids=ids,
                mask=mask,
                positions=positions,
                images=images,
                logits=None,
                routes=[],
            )
            requests = [c for r in group for c in copies[r]]
            jobs.append(Prefill(requests, len(group), ids.shape[1], bool(images), 0, state))
        return jobs, deferred

    def prefill(self, job: Prefill, start: int, end: int) -> None:
        """Columns start..end of a prefill, their keys/values appended to its cache: attention meets a mask of
        chunk x context at most, never one over the whole prompt (docs/internals.md)."""
        s = job.state
        past = s.mask.shape[1] - s.ids.shape[1]
        dtype = None if self.spec.vision else self.model.dtype
        self.adapter_rows = [r.adapter for r in s.group]
        attend = prefill_bias(s.mask[:, : past + end], end - start, dtype)
        s.logits, routes = self._forward(
            s.ids[:, start:end], attend, s.positions[..., start:end], s.cache, **s.images
        )
        s.routes.append(routes)

    def prefilled(self, job: Prefill) -> torch.Tensor:
        """A finished prefill's first-token logits, a row per request (a copy takes its leader's); its rows join
        the running batch."""
        s = job.state
        logits, mask, cache = s.logits, s.mask, s.cache
        routes = None if s.routes[0] is None else torch.cat(s.routes, 1)
        if len(job.requests) > len(s.group):  # the copies take their leader's row of what the forward made
            index = torch.tensor([i for i, r in enumerate(s.group) for _ in s.copies[r]], device=self.device)
            logits, mask = logits[index], mask[index]
            routes = None if routes is None else routes[index.cpu()]
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys[index], layer.values[index]
        for i, r in enumerate(job.requests):
            entry, n = s.reused[r]
            r.route(0, entry.routes if n else None)
            first = s.ids.shape[1] - len(r.prompt) - len(r.tokens) + n  # the row's first column not reused
            r.route(n, None if routes is None else routes[i, first:])
        if self.slots is None:
            keys = cache.layers[0].keys
            self.slots = Slots(
                len(cache.layers),
                keys.shape[1],
                keys.shape[3],
                keys.dtype,
                self.device,
                self.max_batch_size,
                self.spec.max_model_len + 1,
            )
            if self.graphs:
                self.graphs = GraphDecoder(
                    self.model, self.slots, self.spec.cache_kw, self.device.type == "cuda"
                )
        self.slots.merge([(layer.keys, layer.values) for layer in cache.layers], mask)
        first = self.slots.rows - len(job.requests)
        for i, r in enumerate(job.requests):
            # a leader's blocks, stored now: the requests that waited for them take them at the next step
            if self.inflight.pop(r, None) is not None:
                self._keep(first + i, r, r.prompt + r.tokens)
        return logits

    def reset(self, refit: bool = False) -> None:
        """Empty the running batch (storage kept) and forget the prefills in flight; after new weights the prefix
        cache forgets its blocks too."""
        self.inflight.clear()
        if self.slots is not None:
            self.slots.reset()
        if refit:
            self.prefixes.refit()

    def store(self, rows: list[Request]) -> None:
        """Finished rows leave at the next boundary: keep their keys/values (a session's next turn, ...)."""
        for i, r in enumerate(rows):
            if self.prefixes.budget and r.finish not in (None, FinishReason.ABORT) and not r.images:
                self._keep(i, r, (r.prompt + r.tokens)[:-1])

    def _keep(self, i: int, r: Request, tokens: list[int]) -> None:
        """Row i's keys/values, covering `tokens`, into the prefix cache (the blocks it lacks)."""
        self.prefixes.store(tokens, self.slots.row(i), torch.cat(r.routes) if r.routes else None, r.adapter)

    def _graph_decode(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The decode step's logits from a CUDA graph; None without graphs, or (and eager decode from then on)
        where a model's forward cannot be captured: rollouts go on, slower, and the warning says why."""
        if not isinstance(self.graphs, GraphDecoder):
            return None
        try:  # (fp32 logits: the graph's own output buffer, read before the next replay overwrites it)
            return self.graphs(ids, positions).float()
        except RuntimeError as error:
            cause = error.__context__ or error  # a failed capture reports "invalidated" over the real cause
            warnings.warn(f"{self.name}: CUDA graph capture failed, decoding eagerly: {cause}", stacklevel=1)
            self.graph_error, self.graphs = str(cause), False
            return None

    def _forward(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        **images: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Last-position logits [rows, vocab] and, for MoE, the routes [rows, len, layers, k] on the CPU."""
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self.spec.cache_kw: cache},
            **images,
        )
        r, self._routes = self._routes, []
        routes = torch.stack(r, 1).view(*ids.shape, len(r), -1).to("cpu", self._route_dtype) if r else None
        logits = out.logits[:, -1].float()
        if self.banned:  # a text model has none: no indexing kernel on its decode path
            logits[:, self.banned] = -float("inf")
        return logits, routes
