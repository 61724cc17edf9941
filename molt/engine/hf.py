"""The embedded inference engine: a transformers model behind the `Engine` protocol, for CPU and one GPU. It is
the engine core and its in-process client: the asyncio side (generate, abort, pause, refit) hands requests and
state to the scheduler (`molt.engine.scheduler`) under one lock; a worker thread asks the scheduler what each
step does, has the model runner (`molt.engine.runner`) do it, and emits the sampled tokens. `EngineProcess`
(`molt.engine.process`) is the same interface for an engine in a child process.

Design notes and decisions: docs/internals.md, section `molt/engine/hf.py`.
"""

from __future__ import annotations

import asyncio
import functools
import random
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from llguidance import LLMatcher
from llguidance.hf import from_tokenizer

from molt.engine.base import EngineError, EngineGone, RequestError, copy_weights, token_list
from molt.engine.request import Request, failed, resolve
from molt.engine.runner import ModelRunner
from molt.engine.sampling import sample
from molt.engine.scheduler import Scheduler, State, Step
from molt.engine.weight_group import InProcessWeightReceiver
from molt.types import Completion, FinishReason, SamplingParams


class HFEngine(InProcessWeightReceiver):
    """Embedded engine on a transformers causal LM. See the module docstring for the design."""

    def __init__(
        self,
        model_path: str,
        *,
        model_name: str | None = None,
        version: int = 0,
        max_batch_size: int = 64,
        max_prefill_tokens: int = 8192,
        **options: Any,
    ):
        """`options`: the model runner's (`ModelRunner`: dtype, device, prefix cache, CUDA graphs, LoRA)."""
        import transformers as tf

        self.model_name = model_name or Path(model_path).name
        self.runner = runner = ModelRunner(
            model_path,
            name=self.model_name,
            max_batch_size=max_batch_size,
            max_prefill_tokens=max_prefill_tokens,
            **options,
        )
        self.model, self.spec, self.device = runner.model, runner.spec, runner.device
        self.prefixes = runner.prefixes
        self.tokenizer = tf.AutoTokenizer.from_pretrained(model_path)
        self.max_model_len, self.vocab_size = self.spec.max_model_len, self.spec.vocab_size
        self.eos_token_ids = list(self.spec.eos_token_ids)
        # with graphs a decode step is cheap and an eager prefill is not: arrivals wait up to this many steps for
        # company (or a full batch) before they prefill
        self.scheduler = Scheduler(max_batch_size, max_prefill_tokens, hold_steps=8 if runner.graphs else 0)
        self._params = self.model.state_dict()  # tensors share storage with the parameters (tied ones too)
        self._version = version
        self._cv = threading.Condition()  # guards the scheduler's state and lists against the asyncio side
        self._active: dict[str, Request] = {}  # every request not completed yet (asyncio side)
        self._thread = threading.Thread(
            target=self._run, name=f"molt-hf-engine-{self.model_name}", daemon=True
        )
        self._thread.start()

    # ---------------------------------------------------------------- public API (asyncio side)

    @property
    def version(self) -> int:
        return self._version

    @property
    def num_requests(self) -> int:
        """Requests waiting or running."""
        return len(self._active)

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        session_id: str | None = None,
        request_id: str | None = None,
        *,
        on_tokens: Any = None,
        images: Any = None,
        sources: Any = None,  # for engines that process images (vLLM)
    ) -> Completion:
        req = self._make_request(token_list(prompt_ids), params, request_id)
        if images and not self.spec.vision:
            raise RequestError(f"{self.model_name} takes no images")
        req.on_tokens, req.session_id, req.images = on_tokens, session_id, images
        if self.runner.adapters:  # a role without an adapter of its own samples from the base
            req.adapter = params.adapter if params.adapter in self.runner.adapters else "__base__"
        if params.grammar is not None:  # off the event loop: the first one builds llguidance's tokenizer too
            req.matcher = await asyncio.to_thread(self._matcher, params.grammar)
        with self._cv:
            if self.scheduler.state is State.CLOSED:
                raise EngineGone("the engine is closed")
            if req.id in self._active:
                raise RequestError(f"request id {req.id!r} is already in use")
            self._active[req.id] = req
            self.scheduler.waiting.append(req)
            self._cv.notify_all()
        try:
            return await req.future
        except asyncio.CancelledError:
            self._tell(lambda scheduler: scheduler.aborts.append(req))  # it leaves at the next boundary
            raise
        finally:
            with self._cv:
                self._active.pop(req.id, None)

    async def abort(self, request_id: str) -> None:
        with self._cv:
            req = self._active.get(request_id)
        if req is not None:
            self._tell(lambda scheduler: scheduler.aborts.append(req))

    async def pause(self) -> None:
        """Stop scheduling new tokens, keeping every request; returns once the current step has finished."""
        self._tell(Scheduler.pause)
        # paused, or resumed meanwhile
        await asyncio.to_thread(self._wait_for, lambda: self.scheduler.state is not State.PAUSING)

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Copy (HF parameter name, tensor) pairs into the model; may be called several times (buckets)."""
        with self._cv:
            if self.scheduler.state is not State.PAUSED:
                raise EngineError("update_weights must be called while the engine is paused (await pause())")
        await asyncio.to_thread(copy_weights, self._params, named_tensors, self.model_name)
        with self._cv:
            self._version = version
            self.scheduler.recompute = True  # the kept requests prefill again with the new weights

    async def prefix_stats(self) -> dict[str, int]:
        return self.prefixes.stats()

    async def resume(self) -> None:
        self._tell(Scheduler.resume)

    async def close(self) -> None:
        """Abort every request and stop the worker thread."""
        self._tell(Scheduler.close)
        await asyncio.to_thread(self._thread.join)

    def shared_weights(self) -> dict[str, torch.Tensor] | None:
        """A CPU model's tensors, moved into shared memory: an `EngineProcess` parent then refits them in place
        (one copy, no pipe). None on a GPU."""
        if self.device.type != "cpu":
            return None
        for tensor in self._params.values():
            tensor.share_memory_()  # moves the storage, which the parameters hold too
        return self._params

    # ---------------------------------------------------------------- helpers (caller side)

    def _make_request(self, prompt: list[int], params: SamplingParams, request_id: str | None) -> Request:
        # draws on the host (a GPU step would launch a kernel per row); Random(s) seeds from abs(s): the modulus
        # keeps s and -s apart
        seed = None if params.seed is None else params.seed % 2**64
        loop = asyncio.get_running_loop()
        return Request.admit(
            self,
            prompt,
            params,
            request_id,
            generator=random.Random(seed),
            loop=loop,
            future=loop.create_future(),
        )

    @functools.cached_property
    def _grammar_tokenizer(self) -> Any:
        """llguidance's view of the vocabulary, as wide as the logits (built once, 0.3 s for a 49k vocabulary, at
        the first constrained request); a grammar that is complete allows the model's EOS tokens only."""
        return from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)

    def _matcher(self, grammar: str) -> Any:
        """A constrained request's matcher, made before its first token and advanced by each sampled one, so that
        it stays at the request's tokens through a refit's prefill again (keep mode); RequestError where
        llguidance cannot use the grammar with this vocabulary."""
        matcher = LLMatcher(self._grammar_tokenizer, grammar)
        if matcher.is_error():
            raise RequestError(f"grammar: {matcher.get_error()}")
        return matcher

    def _tell(self, change: Any) -> None:
        """Change the scheduler under the lock and wake the worker thread."""
        with self._cv:
            change(self.scheduler)
            self._cv.notify_all()

    def _wait_for(self, predicate: Any) -> None:
        with self._cv:
            self._cv.wait_for(predicate)

    # ---------------------------------------------------------------- engine core (worker thread)

    def _run(self) -> None:
        """The step loop. Every request ends with a result or an error: a step that raises fails the requests it
        held (the kept ones too), and a failure outside a step fails every request and closes the engine."""
        failure: BaseException | None = None
        try:
            self._loop()
        except BaseException as error:  # noqa: BLE001 - ended below, with every request
            failure = error
        self._tell(Scheduler.close)
        with self._cv:
            left = list(self._active.values())
        for req in left:
            if failure is None:  # closed
                req.finish = req.finish or FinishReason.ABORT
                resolve(req, req.completion())
            else:
                resolve(req, error=failed(failure))

    def _loop(self) -> None:
        if self.device.type == "cuda":  # this thread's streams and captures go to its current device
            torch.cuda.set_device(self.device)
        scheduler = self.scheduler
        with torch.inference_mode():
            while True:
                with self._cv:
                    self._cv.wait_for(scheduler.has_work)
                    if scheduler.state is State.CLOSED:
                        return
                    step = scheduler.schedule(lambda rows: self.runner.slots.keep(rows))
                    self._cv.notify_all()  # a pause waits for the boundary
                for req in step.finished:  # resolved once: they left the scheduler's lists
                    resolve(req, req.completion())
                if not step.run:
                    continue
                try:
                    self._step(step)
                except Exception as error:  # noqa: BLE001 - fail the requests rather than leave agents waiting
                    self.runner.reset()
                    for req in dict.fromkeys(scheduler.drop() + step.admitted):
                        resolve(req, error=failed(error))

    def _step(self, step: Step) -> None:
        """Advance every running request by one token, and the prefills by this step's chunks (a prefill's
        requests get their first token with its last chunk)."""
        version, runner = self._version, self.runner
        if step.recompute:  # weights changed: the kept requests prefill again with the new ones
            runner.reset(refit=True)
        if step.decode:
            self._emit(step.decode, runner.decode(step.decode), version)
        jobs, deferred = runner.plan(step.admitted)
        if deferred:  # they wait for a prefill in flight (`ModelRunner.plan`), first in line
            with self._cv:
                self.scheduler.waiting[:0] = deferred
        for job, start, end in self.scheduler.plan(jobs):
            runner.prefill(job, start, end)
            if end == job.columns:
                self._emit(job.requests, runner.prefilled(job), version)
        if runner.graph_error:  # decoding eagerly from now on: arrivals no longer wait for company
            self.scheduler.hold_steps = 0
        runner.store(self.scheduler.running)  # the finished rows' keys/values, before they leave

    def _emit(self, reqs: list[Request], logits: torch.Tensor, version: int) -> None:
        """Sample one token per row (logits [rows, vocab]) and record it; a request aborted during its prefill
        (already finished) takes none."""
        tokens, logprobs, tops = sample(logits, reqs)
        for req, token, logprob, top in zip(reqs, tokens, logprobs, tops):
            if req.finish is not None:
                continue
            req.tokens.append(token)
            if req.matcher is not None:  # a finished grammar allows only EOS: the request then stops below
                req.matcher.consume_token(token)
            req.logprobs.append(logprob)
            req.versions.append(version)
            if req.on_tokens is not None:
                req.loop.call_soon_threadsafe(req.on_tokens, [token])
            if req.params.top_logprobs:
                req.top.append(top[: req.params.top_logprobs])
            if token in req.stops:
                req.finish = FinishReason.STOP
            elif len(req.tokens) >= req.max_new:
                req.finish = FinishReason.LENGTH
