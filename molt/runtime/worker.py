"""A rollout worker: one inference engine, one capture server, and the agent runner, inside one Ray actor.

`RolloutWorker` is a plain class (testable in-process); the runtime wraps it with `ray.remote` as an async
actor, so the capture server (uvicorn), the agent coroutines and the Ray calls share one event loop while the
engine generates on its own thread.

Refit, the two modes of DESIGN.md:
- partial rollout: `engine.pause()`, load, `engine.resume()`: requests in flight are kept and their later tokens
  carry the new version;
- otherwise generation waits at the refit boundary: `RefitGate` stops admitting new requests, lets the ones in
  flight finish, then loads the weights; no single completion mixes versions (a multi-turn rollout still may,
  across its model calls: every token keeps its version).
Weights arrive either as Ray object references of buckets `[(hf_name, tensor), ...]` that the trainer put into
the object store (the worker fetches them one bucket at a time), or over the collective refit group of
`molt.engine.weight_group` (trainer rank 0 broadcasts each bucket; NCCL on GPU, gloo on CPU).
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable
from typing import Any

from molt.engine.base import Engine, can_stream
from molt.runtime.experience import outcome_from_trajectory
from molt.runtime.pool import RolloutOutcome, RolloutTask
from molt.types import Completion, SamplingParams


class RefitGate:
    """An Engine wrapper that can hold new requests back and wait for the ones in flight (no partial rollout)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._open = asyncio.Event()
        self._open.set()
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def __getattr__(self, name: str) -> Any:  # model_name, max_model_len, eos_token_ids, pause, ...
        return getattr(self.engine, name)

    @property
    def can_stream(self) -> bool:
        return can_stream(self.engine)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None,
                       request_id: str | None = None, **kw: Any) -> Completion:  # on_tokens, images
        await self._open.wait()
        self._inflight += 1
        self._idle.clear()
        try:
            return await self.engine.generate(prompt_ids, params, session_id, request_id, **kw)
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    async def drain(self) -> None:
        self._open.clear()
        await self._idle.wait()

    def reopen(self) -> None:
        self._open.set()


class RolloutWorker:
    def __init__(self, model_path: str, agent_path: str, *, engine_kind: str = "hf", torch_threads: int = 0,
                 runner_options: dict[str, Any] | None = None, engine_options: dict[str, Any] | None = None):
        self.model_path, self.agent_path, self.engine_kind = model_path, agent_path, engine_kind
        self.torch_threads = torch_threads
        self.runner_options = runner_options or {}
        self.engine_options = engine_options or {}
        self.engine: Any = None
        self.server: Any = None
        self.runner: Any = None

    async def start(self) -> str:
        """Build the engine, start the capture server, load the agent file; returns the server URL."""
        import torch

        from molt.agents import load_agent
        from molt.capture.render import ChatRenderer
        from molt.capture.server import CaptureServer

        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        if self.engine_kind == "vllm":
            from molt.engine.vllm import VLLMEngine

            engine = VLLMEngine(self.model_path, **self.engine_options)
        else:
            options = dict(self.engine_options)
            if options.pop("process", True):  # the default: see molt.engine.process
                from molt.engine.process import EngineProcess

                engine = EngineProcess("molt.engine.hf:HFEngine", self.model_path, torch_threads=self.torch_threads,
                                       **options)
            else:
                from molt.engine.hf import HFEngine

                engine = HFEngine(self.model_path, **options)
        self.engine = RefitGate(engine)
        self.server = CaptureServer(self.engine, ChatRenderer.from_pretrained(self.model_path))
        await self.server.start()
        self.runner = load_agent(self.agent_path)
        for name, value in self.runner_options.items():
            if hasattr(self.runner, name) and value is not None:
                setattr(self.runner, name, value)  # e.g. timeout, max_turns: the runtime's limits win
        return self.server.url

    async def run(self, task: RolloutTask, params: SamplingParams, train: bool = True) -> RolloutOutcome:
        """One rollout. For training its segments are offloaded into this node's object store; for evaluation
        only the light fields come back."""
        traj = await self.runner.run(task.row, sessions=self.server, rollout_id=task.rollout_id,
                                     group_id=task.group_id, sampling_params=params.copy(seed=task.seed))
        outcome = outcome_from_trajectory(traj, offload=train)
        if not train:
            outcome.experiences = []
        outcome.sample_index = task.sample_index
        return outcome

    async def begin_refit(self, partial: bool) -> None:
        """The refit boundary of the module docstring: with partial rollout pause at once (requests are kept);
        otherwise stop admitting, let the requests in flight finish, then pause."""
        gate: RefitGate = self.engine
        if not partial:
            await gate.drain()
        await gate.engine.pause()

    async def end_refit(self) -> None:
        gate: RefitGate = self.engine
        await gate.engine.resume()
        gate.reopen()

    async def update_weights(self, bucket_refs: Iterable[Any], version: int) -> None:
        """Between begin_refit and end_refit: object refs (or plain lists) of [(name, tensor), ...]."""
        import ray

        for ref in bucket_refs:
            bucket = await ref if isinstance(ref, ray.ObjectRef) else ref  # one bucket in memory at a time
            await self.engine.engine.update_weights(bucket, version)

    async def weight_group_size(self) -> int:
        return int(getattr(self.engine.engine, "weight_group_size", 1))

    async def join_weight_group(self, address: str, rank: int, world: int) -> None:
        """Join the collective refit group (`molt.engine.weight_group`) as ranks rank .. rank + size - 1."""
        await self.engine.engine.join_weight_group(address, rank, world)

    async def receive_weights(self, plan: list, version: int) -> None:
        """Between begin_refit and end_refit: the buckets trainer rank 0 broadcasts over the refit group."""
        await self.engine.engine.receive_weights(plan, version)

    async def weight_sums(self) -> dict[str, float]:
        """{HF name: float64 sum} of an embedded engine's weights: a cheap fingerprint to check a refit."""
        return await self.engine.engine.weight_sums()

    async def version(self) -> int:
        return self.engine.engine.version

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()
        if self.engine is not None:
            await self.engine.engine.close()
