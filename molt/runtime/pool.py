"""The persistent rollout pool: single rollouts in flight, complete prompt groups out, bounded staleness.

Design notes and decisions: docs/internals.md, section `molt/runtime/pool.py`.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
import traceback
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from molt.types import Experience, RolloutStatus, Trajectory, sub_seed


class RunStopped(RuntimeError):
    """The run must stop with a checkpoint (a signal, an engine crash loop); `exit_code` is the process's."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(slots=True)
class RolloutTask:
    """One rollout to run: a dataset row and where its result belongs."""

    row: dict[str, Any]
    key: tuple[int, int]  # (epoch, prompt index): the ledger key of its group
    group_id: str
    rollout_id: str
    sample_index: int
    seed: int = 0


@dataclass(slots=True)
class RolloutOutcome(Trajectory):
    """What a worker returns for one rollout: its trajectory's light fields (no segments) plus offloaded
    experiences (one per segment)."""

    experiences: list[Experience] = field(default_factory=list)
    break_reasons: list[str] = field(default_factory=list)
    response_tokens: int = 0  # action tokens over all segments
    sample_index: int = 0

    @property
    def min_version(self) -> int:
        return min((e.min_version for e in self.experiences if e.num_actions), default=-1)


@dataclass(slots=True)
class Group:
    key: tuple[int, int]
    group_id: str
    row: dict[str, Any]
    outcomes: list[RolloutOutcome]

    @property
    def min_version(self) -> int:
        return min((o.min_version for o in self.outcomes if o.min_version >= 0), default=-1)


class PromptStream:
    """Dataset rows in a seeded shuffled order, epoch after epoch: position n is row `order(e)[n % N]` of epoch
    e = n // N, its ledger key (e, row index).

    A key yielded is open until `finish`ed (trained, or given up: a dropped group). `state()` is what a
    checkpoint keeps, bounded by the keys in flight rather than the run's length: the position of the oldest
    open key (where a resumed stream starts) and the positions after it that were finished (which it skips).
    So a resumed run re-runs exactly the groups that were in flight at the checkpoint, trains nothing twice,
    and, like the run it continues, does not go back to groups it gave up."""

    def __init__(self, rows: list[dict[str, Any]], seed: int, state: dict[str, Any] | None = None):
        if not rows:
            raise ValueError("the prompt dataset is empty")
        self.rows, self.seed = rows, seed
        state = state or {}
        self._next = state.get("next", 0)  # the next position to yield
        self._done = set(state.get("done", ()))  # finished positions after the oldest open one
        self._open: dict[tuple[int, int], int] = {}  # key -> position, yielded and not finished
        self._orders: dict[int, list[int]] = {}

    def order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}  # at most three epochs
            self._orders[epoch] = order = list(range(len(self.rows)))
            random.Random(self.seed + epoch).shuffle(order)
        return self._orders[epoch]

    def __iter__(self) -> Iterator[tuple[tuple[int, int], dict[str, Any]]]:
        while True:
            n, self._next = self._next, self._next + 1
            if n in self._done:
                continue
            epoch = n // len(self.rows)
            key = (epoch, self.order(epoch)[n % len(self.rows)])
            self._open[key] = n
            yield key, self.rows[key[1]]

    def finish(self, key: tuple[int, int]) -> None:
        """The group of `key` was trained or given up."""
        self._done.add(self._open.pop(tuple(key)))
        start = min(self._open.values(), default=self._next)
        self._done = {n for n in self._done if n > start}

    def state(self) -> dict[str, Any]:
        return {"next": min(self._open.values(), default=self._next), "done": sorted(self._done)}


class RolloutPool:
    def __init__(
        self,
        prompts: PromptStream,
        run: Callable[[RolloutTask], Awaitable[RolloutOutcome]],
        *,
        n_samples: int,
        groups_per_step: int,
        max_staleness: int,
        max_retries: int = 2,
        group_filter: Callable[[Group], str | None] | None = None,
        seed: int = 0,
        stall_timeout_s: float = 0.0,
        failure_window: int = 0,
        max_failed_share: float = 1.0,
    ):
        self.prompts, self._prompts = prompts, iter(prompts)
        self._run, self._filter = run, group_filter
        self.n_samples, self.groups_per_step = n_samples, groups_per_step
        self.max_staleness, self.max_retries = max_staleness, max_retries
        self.stall_timeout_s, self.max_failed_share = stall_timeout_s, max_failed_share
        self.version = self._base_version = 0
        self.counters: Counter[str] = Counter()
        self._recent: deque[bool] = deque(maxlen=failure_window)  # whether each of the last rollouts failed
        self._first: dict[str, RolloutOutcome] = {}  # the first failure of each status
        self._failing: RunStopped | None = None
        self._seed = seed
        self._started = 0  # groups dispatched
        self._dropped = 0  # groups dropped (failed, filtered, stale): their budget slots are backfilled
        self._ready: asyncio.Queue[Group] = asyncio.Queue()
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._dispatcher: asyncio.Task | None = None

    # -- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        assert self._dispatcher is None, "pool already started"
        self._base_version = self.version  # a resumed run starts at its checkpoint's version
        self._dispatcher = asyncio.create_task(self._dispatch_loop())

    async def stop(self) -> None:
        for task in [self._dispatcher, *self._tasks]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*[t for t in [self._dispatcher, *self._tasks] if t], return_exceptions=True)
        self._dispatcher = None

    def set_version(self, version: int) -> None:
        """Called after each refit: lets dispatch run ahead up to the staleness bound again."""
        self.version = version
        self._wake.set()

    # -- trainer side ---------------------------------------------------------------------------------------
    async def next_step_groups(self, stop: asyncio.Event | None = None) -> list[Group] | None:
        """Wait for `groups_per_step` complete, kept, fresh-enough groups and hand them out; None once `stop` is
        set (within a second). Raises `RunStopped` when no step can form (the module docstring)."""
        out: list[Group] = []
        start = time.monotonic()
        while len(out) < self.groups_per_step:
            if stop is not None and stop.is_set():
                return None
            if self._dispatcher is not None and self._dispatcher.done():
                self._dispatcher.result()  # surface a dispatcher crash instead of waiting forever
            if self._failing is not None:
                raise self._failing
            if 0 < self.stall_timeout_s <= time.monotonic() - start:
                raise RunStopped(
                    f"no training step formed in {self.stall_timeout_s:g} s (train.stall_timeout_s): "
                    f"{len(out)} of {self.groups_per_step} groups ready; {self._why()}"
                )
            try:
                group = await asyncio.wait_for(self._ready.get(), timeout=1.0)
            except asyncio.TimeoutError:
                continue
            if 0 <= group.min_version < self.version - self.max_staleness:
                self._drop("stale", group.key)
                continue
            out.append(group)
        return out

    # -- dispatch -------------------------------------------------------------------------------------------
    def _budget(self) -> int:
        return (self.version - self._base_version + self.max_staleness + 1) * self.groups_per_step

    def _drop(self, reason: str, key: tuple[int, int]) -> None:
        self.prompts.finish(key)
        self.counters[f"dropped/{reason}"] += 1
        self._dropped += 1
        self._wake.set()

    async def _dispatch_loop(self) -> None:
        while True:
            while self._started - self._dropped >= self._budget():
                self._wake.clear()
                await self._wake.wait()
            key, row = next(self._prompts)
            self._started += 1
            task = asyncio.create_task(self._run_group(key, row))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _task(self, key: tuple[int, int], row: dict, group_id: str, index: int, attempt: int) -> RolloutTask:
        # Ids and seeds are deterministic so that a seeded run is reproducible.
        rid = f"{group_id}-s{index}-a{attempt}"
        return RolloutTask(row, key, group_id, rid, index, sub_seed(self._seed, rid))

    async def _run_group(self, key: tuple[int, int], row: dict[str, Any]) -> None:
        group_id = f"e{key[0]}-p{key[1]}"
        tasks = [self._task(key, row, group_id, i, 0) for i in range(self.n_samples)]
        pending = {asyncio.create_task(self._run(t)): t for t in tasks}
        done: list[RolloutOutcome] = []
        retries = 0
        try:
            while pending:
                finished, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    index = pending.pop(task).sample_index
                    outcome = self._outcome(task, tasks[index])
                    outcome.sample_index = index
                    self._count(outcome)
                    if outcome.ok:
                        done.append(outcome)
                        continue
                    if retries >= self.max_retries:
                        self._drop("group_failed", key)
                        return
                    retries += 1
                    tasks[index] = self._task(key, row, group_id, index, retries)
                    pending[asyncio.create_task(self._run(tasks[index]))] = tasks[index]
        finally:  # the group failed or the pool stops: its other rollouts are dropped (on their worker too)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        group = Group(key, group_id, row, sorted(done, key=lambda o: o.sample_index))
        reason = self._filter(group) if self._filter else None  # e.g. DAPO's: why the group is dropped
        if reason:
            self._drop(reason, key)
        else:
            self._ready.put_nowait(group)

    def _count(self, outcome: RolloutOutcome) -> None:
        """Count a failure by status, print the first of each status, and judge the last rollouts' failed share."""
        reason = outcome.status.value
        self._recent.append(not outcome.ok)
        if outcome.ok:
            return
        self.counters[f"failed/{reason}"] += 1
        if reason not in self._first:
            self._first[reason] = outcome
            print(
                f"molt: first {reason} failure (rollout {outcome.rollout_id}; later ones are counted as "
                f"rollout/failed/{reason}):\n{outcome.traceback or outcome.error}",
                file=sys.stderr,
            )
        failed = sum(self._recent)
        if (
            self._failing is None
            and self._recent.maxlen
            and len(self._recent) == self._recent.maxlen
            and failed >= self.max_failed_share * len(self._recent)
        ):
            self._failing = RunStopped(
                f"{failed} of the last {len(self._recent)} rollouts failed (rollout."
                f"max_failed_share {self.max_failed_share} of rollout.failure_window "
                f"{len(self._recent)}); {self._why()}"
            )

    def _why(self) -> str:
        """The failure and drop counts so far, and the first error of the most frequent failure."""
        counts = ", ".join(f"{k} {n}" for k, n in sorted(self.counters.items()) if n)
        # among this process's failures: a resumed run's counts have no first error here
        reason = max(self._first, key=lambda r: self.counters[f"failed/{r}"], default=None)
        if reason is None:
            return counts or "nothing failed or dropped"
        return f"{counts}; first {reason} (rollout {self._first[reason].rollout_id}): {self._first[reason].error}"

    @staticmethod
    def _outcome(task: asyncio.Task, rollout: RolloutTask) -> RolloutOutcome:
        """A worker crash is a failed rollout, never a crashed pool."""
        rid, group_id = rollout.rollout_id, rollout.group_id
        if task.cancelled():
            return RolloutOutcome(rid, group_id, status=RolloutStatus.ABORTED, error="cancelled")
        exc = task.exception()
        if exc is not None:
            return RolloutOutcome(
                rid,
                group_id,
                status=RolloutStatus.AGENT_ERROR,
                error=f"{type(exc).__name__}: {exc}",
                traceback="".join(traceback.format_exception(exc)),
            )
        return task.result()
