"""A rollout worker: one inference engine, one capture server, and the agent runner, inside one Ray actor.

Design notes and decisions: docs/internals.md, section `molt/runtime/worker.py`.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

from molt.engine.base import Engine, EngineGone, can_stream, unpack_weights
from molt.runtime.experience import outcome_from_trajectory
from molt.runtime.pool import RolloutOutcome, RolloutTask, RunStopped
from molt.types import Completion, RolloutStatus, SamplingParams

RESTART_WINDOW_S = 600.0


class RestartBudget:
    """At most `limit` deaths of an engine or a worker within RESTART_WINDOW_S, each one replaced."""

    def __init__(self, limit: int):
        self.limit, self.deaths = limit, []

    def died(self, what: str, setting: str) -> str:
        """Count a death of `what`: RunStopped past the limit (the config field `setting`), else the warning
        line that says a new one starts."""
        now = time.monotonic()
        self.deaths = [t for t in self.deaths if now - t < RESTART_WINDOW_S] + [now]
        n, window = len(self.deaths), f"within {RESTART_WINDOW_S:.0f} s"
        if n > self.limit:
            raise RunStopped(
                f"{what}, {n} time(s) {window}; the run survives {self.limit} ({setting}; none with the "
                "collective refit group)"
            )
        return f"molt: warning: {what}; starting a new one (restart {n} of {self.limit} {window}, {setting})"


def exit_status(code: int) -> str:
    """A process's exit code as people read it: a negative one is the signal that killed it."""
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def logged_cause() -> str:
    """The last exception line in this process's output files (a Ray worker's logs, where vLLM's processes
    print why they died), "?" if none."""
    text = ""
    for fd in (1, 2):
        path = os.path.realpath(f"/proc/self/fd/{fd}")
        if os.path.isfile(path):
            with open(path, "rb") as f:
                f.seek(max(0, os.path.getsize(path) - 65536))
                text += f.read().decode(errors="replace")
    found = re.findall(r"\b([A-Z]\w*(?:Error|Exception): .+)$", text, re.MULTILINE)
    return next((line for line in reversed(found) if "EngineDead" not in line), "?")


class RefitGate:
    """What the capture server calls the engine: it holds new requests back and waits for the ones in flight (the
    refit without partial rollout), and a revived engine takes the old one's place behind it (`engine`). It
    stays here rather than in the engine core's pause modes: it serves every engine kind alike (vLLM's
    wrapper pauses with its requests kept only), and it holds a request before the engine sees it. It names
    what the capture server uses; the worker calls the engine itself for the rest."""

    def __init__(self, engine: Engine):
        self.engine = engine  # a revived one has the same model: the names below stay true
        self.model_name, self.max_model_len, self.eos_token_ids = (
            engine.model_name,
            engine.max_model_len,
            engine.eos_token_ids,
        )
        self._open = asyncio.Event()
        self._open.set()
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.gone: EngineGone | None = None  # the engine said it is gone (a dead process is revived)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    @property
    def can_stream(self) -> bool:
        return can_stream(self.engine)

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        session_id: str | None = None,
        request_id: str | None = None,
        **kw: Any,
    ) -> Completion:  # on_tokens, images
        await self._open.wait()
        self._inflight += 1
        self._idle.clear()
        try:
            return await self.engine.generate(prompt_ids, params, session_id, request_id, **kw)
        except EngineGone as e:
            self.gone = e
            raise
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
    def __init__(
        self,
        model_path: str,
        agent_path: str | list,  # an agent file, or hub environments (molt.envs.env_specs)
        *,
        engine_kind: str = "hf",
        torch_threads: int = 0,
        runner_options: dict[str, Any] | None = None,
        engine_options: dict[str, Any] | None = None,
        max_restarts: int = 3,
        tool_parser: str = "auto",
        roles: str = "",
    ):
        self.model_path, self.agent_path, self.engine_kind = model_path, agent_path, engine_kind
        self.torch_threads, self.tool_parser, self.roles = torch_threads, tool_parser, roles
        self.runner_options = runner_options or {}
        self.engine_options = engine_options or {}
        self.engine: Any = None
        self.server: Any = None
        self.runner: Any = None
        self.restarts, self._refitting = 0, False
        self.news: list[str] = []  # warning lines for the controller, handed over at the next refit
        self._budget = RestartBudget(max_restarts)
        self._restart_lock = asyncio.Lock()
        self._weights: tuple[list, int] | None = None  # the last refit's buckets and version

    async def start(self) -> str:
        """Build the engine, start the capture server, load the agent file; returns the server URL. An engine
        process is spawned first, so that its start-up (imports, model load) overlaps this process's own."""
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        engine = self._new_engine(wait=False)
        try:
            from molt.capture.render import ChatRenderer

            renderer = ChatRenderer.from_pretrained(self.model_path)
            getattr(engine, "started", lambda: None)()  # an engine process: the handshake, after our imports
        except BaseException:
            await engine.close()
            raise
        from molt.agents import load_agent
        from molt.capture.server import CaptureServer

        self.engine = RefitGate(engine)
        self.server = CaptureServer(self.engine, renderer, tool_parser=self.tool_parser, roles=self.roles)
        await self.server.start()
        if isinstance(self.agent_path, list):  # hub environments: (env.id entry, its arguments) each
            from molt.envs import EnvRunner

            self.runner = EnvRunner(self.agent_path, **self.runner_options)
            return self.server.url
        self.runner = load_agent(self.agent_path)
        for name, value in self.runner_options.items():
            if hasattr(self.runner, name) and value is not None:
                setattr(self.runner, name, value)  # e.g. timeout, max_turns: the runtime's limits win
        return self.server.url

    def _new_engine(self, wait: bool = True) -> Engine:
        """`wait=False`: an engine process is returned as soon as it is spawned (`EngineProcess.started`)."""
        options, spawned = dict(self.engine_options), None
        # first, an engine process (the default: see molt.engine.process): its start-up overlaps our imports
        if self.engine_kind == "hf" and options.pop("process", True):
            from molt.engine.process import EngineProcess

            spawned = EngineProcess(
                "molt.engine.hf:HFEngine",
                self.model_path,
                torch_threads=self.torch_threads,
                wait=wait,
                **options,
            )
        import torch

        # this process's pool: an in-process engine decodes in it, a refit copies in it
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        if spawned is not None:
            return spawned
        if self.engine_kind == "vllm":
            from molt.engine.vllm import VLLMEngine

            return VLLMEngine(self.model_path, **self.engine_options)
        from molt.engine.hf import HFEngine

        return HFEngine(self.model_path, **options)

    async def revive(self) -> bool:
        """Start a new engine if the engine process died (module docstring); whether it did."""
        async with self._restart_lock:
            return await self._revive()

    async def _revive(self) -> bool:
        code = getattr(self.engine.engine, "exitcode", None)
        while code is not None:
            during = " in a refit" if self._refitting else ""
            died = f"the engine process died ({exit_status(code)}){during}"
            self.news.append(self._budget.died(died, "rollout.engine_max_restarts"))
            new = await asyncio.to_thread(self._new_engine, False)
            try:
                await asyncio.to_thread(getattr(new, "started", lambda: None))
                await new.pause()
                refs, version = self._weights or ([], 0)
                async for bucket in self._buckets(refs):
                    await new.update_weights(bucket, version)
                if not self._refitting:  # within a refit it stays paused, as the one it replaces was
                    await new.resume()
            except EngineGone:  # the new one died too before it served anything: one more death, one more try
                await new.close()
                code = new.exitcode
                continue
            await self.engine.engine.close()
            self.engine.engine = new
            self.restarts += 1
            return True
        return False

    async def _engine(self, method: str, *args: Any) -> None:
        """A refit call on the engine. If its process died, a new engine stands in, holding the refit's weights
        and version and paused within a refit, so the call is done. Revivals wait for the call (one lock): a
        revival that began before the refit would otherwise swap in an engine that missed it."""
        async with self._restart_lock:
            try:
                await getattr(self.engine.engine, method)(*args)
            except EngineGone:
                if not await self._revive():
                    raise

    async def run(self, task: RolloutTask, params: SamplingParams, train: bool = True) -> AsyncIterator[Any]:
        """One rollout, for Ray's num_returns="streaming": the outcome (only its light fields for evaluation),
        then each experience's payload: objects the caller owns, which outlive this actor (docs/internals.md)."""
        await self.revive()  # a request sent now would fail on a dead engine; wait for its successor
        restarts = self.restarts
        traj = await self.runner.run(
            task.row,
            sessions=self.server,
            rollout_id=task.rollout_id,
            group_id=task.group_id,
            sampling_params=params.copy(seed=task.seed),
        )
        if not traj.ok and (await self.revive() or self.restarts != restarts):
            traj.status = RolloutStatus.ENGINE_RESTART
        elif self.engine.gone is not None and not hasattr(self.engine.engine, "exitcode"):
            # no process of ours to revive (vLLM's EngineCore died, or an in-process engine's loop): the run
            # ends, with the cause its processes printed to this one's output, Ray's log files no one reads
            raise RunStopped(
                f"the engine is gone for good ({self.engine.gone}); its last error: {logged_cause()}"
            )
        outcome = outcome_from_trajectory(traj)
        payloads = [e.split() for e in outcome.experiences] if train else []
        outcome.experiences, outcome.sample_index = outcome.experiences if train else [], task.sample_index
        yield outcome
        for payload in payloads:
            yield payload

    async def begin_refit(self, partial: bool) -> None:
        """The refit boundary of the module docstring: with partial rollout pause at once (requests are kept);
        otherwise stop admitting, let the requests in flight finish, then pause."""
        if not partial:
            await self.engine.drain()
        self._refitting = True
        await self._engine("pause")

    async def end_refit(self) -> list[str]:
        """Resume; the warnings since the last refit (engine restarts), which this process cannot show."""
        self._refitting = False
        try:
            await self._engine("resume")
        finally:  # admitted requests fail rather than wait forever at a closed gate
            self.engine.reopen()
        news, self.news = self.news, []
        return news

    async def update_weights(self, bucket_refs: Iterable[Any], version: int) -> None:
        """Between begin_refit and end_refit: object refs (or plain lists) of [(name, tensor), ...]."""
        self._weights = list(bucket_refs), version
        async for bucket in self._buckets(self._weights[0]):
            await self._engine("update_weights", bucket, version)

    @staticmethod
    async def _buckets(refs: list) -> Any:
        import ray

        for ref in refs:  # one bucket in memory at a time
            yield unpack_weights(await ref if isinstance(ref, ray.ObjectRef) else ref)

    async def weight_group_size(self) -> int:
        return int(getattr(self.engine.engine, "weight_group_size", 1))

    async def join_weight_group(self, address: str, rank: int, world: int) -> None:
        """Join the collective refit group (`molt.engine.weight_group`) as ranks rank .. rank + size - 1."""
        self._budget.limit = 0  # a new engine could not join the group
        await self.engine.engine.join_weight_group(address, rank, world)

    async def receive_weights(self, plan: list, version: int) -> None:
        """Between begin_refit and end_refit: the buckets trainer rank 0 broadcasts over the refit group."""
        await self._engine("receive_weights", plan, version)

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


class Workers:
    """The controller's rollout worker actors: least-loaded dispatch, refits, a new actor for a dead one."""

    def __init__(
        self,
        spawn: Callable[[int, int], Any],
        n: int,
        max_restarts: int,
        stopping: asyncio.Event | None = None,
    ):
        """spawn(i, n): a new actor for worker i of n; `stopping`: the run's stop (no new actor then)."""
        self.spawn, self.budget = spawn, RestartBudget(max_restarts)
        self.stopping = stopping or asyncio.Event()
        self.actors, self.inflight = [spawn(i, n) for i in range(n)], [0] * n
        self.restarts = {"engine/restarts": 0, "worker/restarts": 0}  # cumulative, in the run's checkpoints
        # the last refit's (trainer ranks' refs, version)
        self.weights: tuple[asyncio.Future, int] | None = None
        self._lock = asyncio.Lock()  # held by refits and replacements; a dispatch waits for them

    async def run(self, task: RolloutTask, params: SamplingParams, train: bool) -> RolloutOutcome:
        import ray
        from ray.exceptions import RayActorError

        async with self._lock:
            i = min(range(len(self.actors)), key=self.inflight.__getitem__)
            actor = self.actors[i]
        self.inflight[i] += 1
        stream = actor.run.options(num_returns="streaming").remote(task, params, train)
        try:
            outcome = await (await stream.__anext__())
            for e in outcome.experiences:
                e.payload_ref = await stream.__anext__()
            return outcome
        # a dropped rollout: end it on the worker too (its agent, its engine requests)
        except asyncio.CancelledError:
            ray.cancel(stream)
            raise
        except RayActorError as e:
            # stopping, a new worker would only delay the run's end (a Slurm requeue's TERM reaches every
            # worker), and failing at once would dispatch the next rollout to the dead one: wait to be dropped
            if self.stopping.is_set():
                await asyncio.Future()
            await self._replace(i, actor, e)
            return RolloutOutcome(
                task.rollout_id, task.group_id, status=RolloutStatus.WORKER_RESTART, error=repr(e)[:500]
            )
        finally:
            self.inflight[i] -= 1

    async def refit(self, partial: bool, refs: asyncio.Future, version: int) -> None:
        """Load the weights (a future of the trainer ranks' bucket refs) into every worker; replace dead ones."""
        from ray.exceptions import RayActorError

        async with self._lock:
            actors, self.weights = list(self.actors), (refs, version)
            done = await asyncio.gather(
                *[self._refit(a, partial, refs, version) for a in actors], return_exceptions=True
            )
        for i, (actor, result) in enumerate(zip(actors, done)):
            if isinstance(result, RayActorError):
                await self._replace(i, actor, result)
            elif isinstance(result, BaseException):
                raise result
            else:  # the worker's engine restarts since the last refit
                for line in result:
                    print(
                        line.replace("molt: warning: ", f"molt: warning: rollout worker {i}: "),
                        file=sys.stderr,
                    )
                self.restarts["engine/restarts"] += len(result)

    @staticmethod
    async def _refit(actor: Any, partial: bool, refs: Awaitable[list], version: int) -> list[str]:
        await actor.begin_refit.remote(partial)
        try:
            await actor.update_weights.remote((await refs)[0], version)
        finally:
            news = await actor.end_refit.remote()
        return news

    async def _replace(self, i: int, dead: Any, error: Exception) -> None:
        import ray

        async with self._lock:
            if self.actors[i] is not dead or self.stopping.is_set():
                return  # another of its rollouts found out first, or a refit found it while stopping
            why = re.search(r"exit detail: ([^.]*)", str(error))  # Ray's words for how its process ended
            died = f"rollout worker {i} died ({type(error).__name__}{f': {why[1]}' if why else ''})"
            print(self.budget.died(died, "rollout.worker_max_restarts"), file=sys.stderr)
            self.restarts["worker/restarts"] += 1
            ray.kill(dead)  # in case it was only unreachable
            self.actors[i] = new = self.spawn(i, len(self.actors))
            await new.start.remote()
            if self.weights is not None:
                await self._refit(new, False, *self.weights)
