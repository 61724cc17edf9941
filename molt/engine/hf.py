"""The embedded inference engine: a transformers model behind the `Engine` protocol, for CPU and one GPU.

Design notes and decisions: docs/internals.md, section `molt/engine/hf.py`.
"""
from __future__ import annotations

import asyncio
import random
import threading
import uuid
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from molt.engine.base import EngineError, EngineGone, RequestError, check_request, copy_weights
from molt.engine.prefix_cache import PrefixCache, copies_of, prefill_groups, prefill_inputs
from molt.engine.request import Request as _Request  # hf.py's old names
from molt.engine.request import failed as _failed
from molt.engine.request import resolve as _resolve
from molt.engine.sampling import sample
from molt.engine.slots import GraphDecoder, Slots, adapt_model, engine_device, prefill_bias
from molt.engine.weight_group import InProcessWeightReceiver
from molt.types import Completion, FinishReason, ModelSpec, SamplingParams, join_inputs, rope_positions


class HFEngine(InProcessWeightReceiver):
    """Embedded engine on a transformers causal LM. See the module docstring for the batching design."""

    def __init__(self, model_path: str, *, model_name: str | None = None, dtype: str = "float32",
                 device: str = "cpu", max_batch_size: int = 64, version: int = 0,
                 max_prefill_tokens: int = 8192, prefix_cache_mb: float = 1024, prefix_cache_stale: bool = False,
                 cuda_graphs: bool = True, lora: dict[str, Any] | None = None):
        import transformers as tf

        if not hasattr(torch, dtype) or not isinstance(getattr(torch, dtype), torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r} (use e.g. 'float32', 'bfloat16')")
        self.device = engine_device(device)
        self.spec = spec = ModelSpec.from_pretrained(model_path)
        self.vision, self.banned = spec.vision, list(spec.banned)  # banned: never sampled (module docstring)
        self.model = spec.auto_class.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(self.device)
        if lora:  # the trainer's adapters (PEFT LoraConfig arguments), zero until a refit loads them by name
            from peft import LoraConfig, inject_adapter_in_model

            inject_adapter_in_model(LoraConfig(**lora), self.model)
        self.model.eval()
        adapt_model(self.model, text=not self.vision)  # its decode attention and output head
        self.tokenizer = tf.AutoTokenizer.from_pretrained(model_path)
        self.model_name = model_name or Path(model_path).name
        self.max_model_len, self.vocab_size, self.pad_token_id = spec.max_model_len, spec.vocab_size, spec.pad_token_id
        self.eos_token_ids = list(spec.eos_token_ids)
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self._cache_kw = spec.cache_kw
        self._new_cache = lambda: tf.DynamicCache(config=self.model.config.get_text_config())
        layer_types = {type(layer).__name__ for layer in self._new_cache().layers}
        if layer_types != {"DynamicLayer"}:  # sliding-window layers cannot be left-padded and merged
            raise ValueError(f"HFEngine supports full-attention caches only, got {sorted(layer_types)}")
        self._routes: list[torch.Tensor] = []  # MoE: each router's top-k experts in this forward, in layer order
        routers = [m for m in self.model.modules() if type(m).__name__.endswith("TopKRouter")]
        for router in routers:
            router.register_forward_hook(lambda _m, _a, out: self._routes.append(out[2]))
        self._route_dtype = torch.uint8 if all(r.weight.shape[0] <= 256 for r in routers) else torch.int16
        # CUDA graphs for the decode step (molt.engine.slots), not where a step needs Python (route hooks, images)
        self._graphs: GraphDecoder | bool = cuda_graphs and self.device.type == "cuda" and not routers \
            and not self.vision and not spec.dynamic_rope  # the decoder itself once the slots exist
        # with graphs a decode step is cheap and an eager prefill is not: arrivals wait up to this many steps for
        # company (or a full batch) before they prefill
        self.hold_steps, self._held = (8 if self._graphs else 0), 0
        self.graph_error: str | None = None  # why graphs were given up, if they were (`_graph_decode`)
        self._params = self.model.state_dict()  # tensors share storage with the parameters (tied ones too)
        self._version = version
        self.prefixes = PrefixCache(prefix_cache_mb, prefix_cache_stale)  # owned by the worker thread
        # state shared with the worker thread, guarded by _cv
        self._cv = threading.Condition()
        self._waiting: list[_Request] = []
        self._active: dict[str, _Request] = {}
        self._paused = self._busy = self._closed = self._stale_cache = False
        self._abort_pending = False
        # owned by the worker thread
        self._rows: list[_Request] = []  # row i's keys/values are slot i of _slots (made at the first prefill)
        self._slots: Slots | None = None
        self._thread = threading.Thread(target=self._run, name=f"molt-hf-engine-{self.model_name}", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- public API (asyncio side)

    @property
    def version(self) -> int:
        return self._version

    @property
    def num_requests(self) -> int:
        """Requests waiting or running (the router balances on this)."""
        return len(self._active)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None,
                       request_id: str | None = None, *, on_tokens: Any = None, images: Any = None,
                       sources: Any = None) -> Completion:  # sources: for engines that process images (vLLM)
        req = self._make_request(list(prompt_ids), params, request_id)
        if images and not self.vision:
            raise RequestError(f"{self.model_name} takes no images")
        req.on_tokens, req.session_id, req.images = on_tokens, session_id, images
        with self._cv:
            if self._closed:
                raise EngineGone("the engine is closed")
            if req.id in self._active:
                raise RequestError(f"request id {req.id!r} is already in use")
            self._active[req.id] = req
            self._waiting.append(req)
            self._cv.notify_all()
        try:
            return await req.future
        except asyncio.CancelledError:
            self._abort(req)  # the worker drops it at the next step boundary
            raise
        finally:
            with self._cv:
                self._active.pop(req.id, None)

    async def abort(self, request_id: str) -> None:
        with self._cv:
            req = self._active.get(request_id)
        if req is not None:
            self._abort(req)

    async def pause(self) -> None:
        """Stop scheduling new tokens; returns once the current step has finished."""
        with self._cv:
            self._paused = True
        await asyncio.to_thread(self._wait_idle)

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Copy (HF parameter name, tensor) pairs into the model; may be called several times (buckets)."""
        with self._cv:
            if not self._paused:
                raise EngineError("update_weights must be called while the engine is paused (await pause())")
        await asyncio.to_thread(copy_weights, self._params, named_tensors, self.model_name)
        with self._cv:
            self._version = version
            self._stale_cache = True

    async def prefix_stats(self) -> dict[str, int]:
        return self.prefixes.stats()

    async def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    async def close(self) -> None:
        """Abort every request and stop the worker thread."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        await asyncio.to_thread(self._thread.join)

    # ---------------------------------------------------------------- helpers (caller side)

    def _make_request(self, prompt: list[int], params: SamplingParams, request_id: str | None) -> _Request:
        max_new = check_request(prompt, params, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                                model_name=self.model_name)
        # draws on the host (a GPU step would launch a kernel per row); Random(s) seeds from abs(s): the modulus
        # keeps s and -s apart
        seed, loop = None if params.seed is None else params.seed % 2**64, asyncio.get_running_loop()
        return _Request(id=request_id or uuid.uuid4().hex, prompt=prompt, params=params, max_new=max_new,
                        stops=sorted(set(self.eos_token_ids) | set(params.stop_token_ids)),
                        generator=random.Random(seed), loop=loop, future=loop.create_future())

    def _abort(self, req: _Request) -> None:
        with self._cv:
            req.aborted = self._abort_pending = True
            self._cv.notify_all()

    def _wait_idle(self) -> None:
        with self._cv:
            self._cv.wait_for(lambda: not self._busy)

    def shared_weights(self) -> dict[str, torch.Tensor] | None:
        """A CPU model's tensors, moved into shared memory: an `EngineProcess` parent then refits them in place
        (one copy, no pipe). None on a GPU."""
        if self.device.type != "cpu":
            return None
        for tensor in self._params.values():
            tensor.share_memory_()  # moves the storage, which the parameters hold too
        return self._params

    # ---------------------------------------------------------------- worker thread

    def _run(self) -> None:
        """The step loop. Every request ends with a result or an error: a step that raises fails the requests it
        held (the kept ones too), and a failure outside a step fails every request and closes the engine."""
        failure: BaseException | None = None
        try:
            self._loop()
        except BaseException as error:  # noqa: BLE001 - ended below, with every request
            failure = error
        with self._cv:
            self._closed, self._busy = True, False
            self._cv.notify_all()
            left = list(self._active.values())
        for req in left:
            if failure is None:  # closed
                req.finish = req.finish or FinishReason.ABORT
                _resolve(req, req.completion())
            else:
                _resolve(req, error=_failed(failure))

    def _loop(self) -> None:
        if self.device.type == "cuda":  # this thread's streams and captures go to its current device
            torch.cuda.set_device(self.device)
        with torch.inference_mode():
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: self._closed or self._abort_pending or (
                        not self._paused and bool(self._waiting or self._rows)))
                    if self._closed:
                        return
                    self._sweep()
                    if self._paused or not (self._waiting or self._rows):
                        continue
                    free = max(self.max_batch_size - len(self._rows), 0)
                    new = self._waiting[:free]
                    if self._rows and 0 < len(new) < free and self._held < self.hold_steps:
                        new, self._held = [], self._held + 1  # let arrivals gather (docs/internals.md)
                    else:
                        self._held = 0
                    self._waiting = self._waiting[len(new):]
                    if self._stale_cache:  # weights changed: the kept requests prefill again with the new ones
                        new, self._stale_cache = self._drop_rows() + new, False
                        self.prefixes.refit()
                    self._busy = True
                try:
                    self._step(new)
                except Exception as error:  # noqa: BLE001 - fail the requests rather than leave agents waiting
                    for req in self._drop_rows() + new:
                        _resolve(req, error=_failed(error))
                finally:
                    with self._cv:
                        self._busy = False
                        self._cv.notify_all()

    def _drop_rows(self) -> list[_Request]:
        """Empty the running batch (its keys and values too); returns its requests."""
        rows, self._rows = self._rows, []
        if self._slots is not None:
            self._slots.reset()
        return rows

    def _sweep(self) -> None:
        """At a step boundary (under the lock): end aborted requests, release finished rows."""
        self._abort_pending = False
        for req in self._rows + self._waiting:
            if req.aborted and req.finish is None:
                req.finish = FinishReason.ABORT
            if req.finish is not None:  # resolved once: it leaves the lists below
                _resolve(req, req.completion())
        self._waiting = [r for r in self._waiting if r.finish is None]
        keep = [i for i, r in enumerate(self._rows) if r.finish is None]
        if len(keep) == len(self._rows):
            return
        self._rows = [self._rows[i] for i in self._slots.keep(keep)]

    def _step(self, new: list[_Request]) -> None:
        """Advance every running request and every new one by exactly one token."""
        version = self._version
        if self._rows:
            slots = self._slots
            positions = slots.advance()
            if any(r.rope_offset for r in self._rows):
                positions = positions + torch.tensor([[r.rope_offset] for r in self._rows], device=self.device)
            ids = torch.tensor([[r.tokens[-1]] for r in self._rows], device=self.device)
            logits, routes = self._graph_decode(ids, positions), None
            if logits is None:
                n, columns = slots.rows, slots.width + 1
                column = torch.tensor([slots.width], device=self.device)
                logits, routes = self._forward(ids, slots.bias(n, columns, self.model.dtype), positions,
                                               slots.view(n, columns, column))
            slots.width += 1
            for i, r in enumerate(self._rows):
                r.route(len(r.prompt) + len(r.tokens) - 1, None if routes is None else routes[i])
            self._emit(self._rows, logits, version)
        reused = {r: self.prefixes.lookup(None if r.images else r.session_id, r.prompt + r.tokens) for r in new}
        copies = copies_of(new, reused)
        work = {r: len(r.prompt) + len(r.tokens) - reused[r][1] for r in copies}
        for group in prefill_groups(list(copies), work, self.max_prefill_tokens):
            cache = self._new_cache()
            ids, mask, positions = (t.to(self.device) for t in prefill_inputs(
                [r.prompt + r.tokens for r in group], [reused[r] for r in group], self.pad_token_id, cache))
            images = join_inputs(*(r.images for r in group))
            positions, offsets = rope_positions(self.model, ids, mask, positions, images)
            for r, offset in zip(group, offsets):
                for c in copies[r]:
                    c.rope_offset = offset
            logits, routes = self._prefill(ids, mask, positions, cache, {k: v.to(self.device, self.model.dtype)
                                           if v.is_floating_point() else v.to(self.device) for k, v in (images or {}).items()})
            if any(len(copies[r]) > 1 for r in group):  # the copies take their leader's row of what the forward made
                index = torch.tensor([i for i, r in enumerate(group) for _ in copies[r]], device=self.device)
                group, logits, mask = [c for r in group for c in copies[r]], logits[index], mask[index]
                routes = None if routes is None else routes[index.cpu()]
                for layer in cache.layers:
                    layer.keys, layer.values = layer.keys[index], layer.values[index]
            for i, r in enumerate(group):
                entry, n = reused[r]
                r.kv_version = min(entry.version, version) if n else version
                r.route(0, entry.routes[:n] if n and entry.routes is not None else None)
                r.route(n, None if routes is None else routes[i, ids.shape[1] - len(r.prompt) - len(r.tokens) + n:])
            self._emit(group, logits, version)
            self._merge(group, cache, mask)
        if self.prefixes.budget:  # finished rows leave at the sweep: keep their keys/values for the next turn
            for i, r in enumerate(self._rows):
                if r.finish is not None and r.session_id is not None and not r.images:
                    layers = self._slots.row(i)
                    self.prefixes.store(r.session_id, (r.prompt + r.tokens)[:-1], layers, r.kv_version, r.routes)
        with self._cv:
            self._sweep()

    def _graph_decode(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The decode step's logits from a CUDA graph; None without graphs, or (and eager decode from then on)
        where a model's forward cannot be captured: rollouts go on, slower, and the warning says why."""
        if not isinstance(self._graphs, GraphDecoder):
            return None
        try:  # (fp32 logits: the graph's own output buffer, read before the next replay overwrites it)
            return self._graphs(ids, positions).float()
        except RuntimeError as error:
            cause = error.__context__ or error  # a failed capture reports "invalidated" over the real cause
            warnings.warn(f"{self.model_name}: CUDA graph capture failed, decoding eagerly: {cause}", stacklevel=1)
            self.graph_error, self._graphs, self.hold_steps = str(cause), False, 0
            return None

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any,
                 images: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A prefill group's forward in chunks of at most max_prefill_tokens new tokens (rows x chunk columns),
        each chunk's keys/values appended to `cache`: attention meets a mask of chunk x context at most, never
        one over the whole prompt (docs/internals.md). Images enter whole: their placeholders are not split."""
        total, past = ids.shape[1], mask.shape[1] - ids.shape[1]
        size = total if images else max(1, self.max_prefill_tokens // ids.shape[0])
        routes = []
        for start in range(0, total, size):
            end = min(start + size, total)
            attend = prefill_bias(mask[:, :past + end], end - start, None if self.vision else self.model.dtype)
            logits, r = self._forward(ids[:, start:end], attend, positions[..., start:end], cache, **images)
            routes.append(r)
        return logits, None if routes[0] is None else torch.cat(routes, 1)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any,
                 **images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Last-position logits [rows, vocab] and, for MoE, the routes [rows, len, layers, k] on the CPU."""
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1, **{self._cache_kw: cache}, **images)
        r, self._routes = self._routes, []
        routes = torch.stack(r, 1).view(*ids.shape, len(r), -1).to("cpu", self._route_dtype) if r else None
        logits = out.logits[:, -1].float()
        if self.banned:  # a text model has none: no indexing kernel on its decode path
            logits[:, self.banned] = -float("inf")
        return logits, routes

    def _merge(self, group: list[_Request], cache: Any, mask: torch.Tensor) -> None:
        """Append a prefilled group's rows to the running batch (the slots are made at the first group)."""
        if self._slots is None:
            keys = cache.layers[0].keys
            self._slots = Slots(len(cache.layers), keys.shape[1], keys.shape[3], keys.dtype, self.device,
                                self.max_batch_size, self.max_model_len + 1)
            if self._graphs:
                self._graphs = GraphDecoder(self.model, self._slots, self._cache_kw, self.device.type == "cuda")
        self._slots.merge([(layer.keys, layer.values) for layer in cache.layers], mask)
        self._rows += group

    def _emit(self, reqs: list[_Request], logits: torch.Tensor, version: int) -> None:
        """Sample one token per row (logits [rows, vocab]) and record it."""
        tokens, logprobs, tops = sample(logits, reqs)
        for req, token, logprob, top in zip(reqs, tokens, logprobs, tops):
            req.tokens.append(token)
            req.logprobs.append(logprob)
            req.versions.append(min(version, req.kv_version))  # older only over a stale prefix
            if req.on_tokens is not None:
                req.loop.call_soon_threadsafe(req.on_tokens, [token])
            if req.params.top_logprobs:
                req.top.append(top[: req.params.top_logprobs])
            if token in req.stops:
                req.finish = FinishReason.STOP
            elif len(req.tokens) >= req.max_new:
                req.finish = FinishReason.LENGTH
