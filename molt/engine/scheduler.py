"""The embedded engine's scheduler: what each step of the engine core (`molt.engine.hf`) does, decided over
request records with plain ints and lists, as vLLM v1's scheduler decides for its engine core. No torch: the
model runner (`molt.engine.runner`) does the forwards.

Design notes and decisions: docs/internals.md, section `molt/engine/scheduler.py`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from molt.types import FinishReason


class State(enum.Enum):
    """The engine core's state: the asyncio side changes it, the worker thread acts on it at step boundaries."""

    RUNNING = "running"  # steps run while there is work
    PAUSING = "pausing"  # pause() was asked: the step in flight ends first, then PAUSED
    PAUSED = "paused"  # no step runs, requests are kept (vLLM's pause mode "keep"): weights may be loaded
    CLOSED = "closed"


@dataclass(eq=False)
class Prefill:
    """Requests prefilled together (left-padded, one forward per chunk of columns) until their first token."""

    requests: list[Any]  # in the order their rows join the running batch
    rows: int  # rows of the forward (copies of one context share a row)
    columns: int  # tokens each row prefills (the longest row's; the others are left-padded)
    whole: bool = False  # in one chunk (images: their placeholders are not split)
    done: int = 0  # columns computed so far
    state: Any = None  # the model runner's: inputs, cache, last logits


@dataclass
class Step:
    decode: list[Any]  # the running batch, in slot order: every row advances by one token
    admitted: list[Any]  # requests that begin prefilling (the runner groups them into `Prefill`s)
    finished: list[Any]  # requests that left (finished, aborted): complete them
    recompute: bool = False  # new weights: the runner drops its batch; the kept requests are in `admitted`
    run: bool = True  # whether there is anything to compute (not while paused)


class Scheduler:
    """Decides, at each step boundary: departures, admissions (free rows; with `hold_steps`, arrivals wait a
    few steps for company), the decode batch, and how many columns of which prefill run in this step (at most
    `budget` tokens, rows x columns, across steps: chunked prefill). The engine holds its lock around
    `schedule`; `plan` runs on the worker thread only."""

    def __init__(self, max_rows: int, budget: int, hold_steps: int = 0):
        if budget < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {budget}")
        self.max_rows, self.budget, self.hold_steps = max_rows, budget, hold_steps
        self.state = State.RUNNING
        self.waiting: list[Any] = []  # not admitted yet, in arrival order
        self.running: list[Any] = []  # the running batch, in slot order
        self.jobs: list[Prefill] = []  # prefills in progress, oldest first
        self.aborts: list[Any] = []  # aborted since the last boundary
        self.recompute = False  # weights changed while paused: the kept requests prefill again
        self._held = 0  # steps the current arrivals have waited for company

    def has_work(self) -> bool:
        """Whether the worker thread has something to do at the next boundary (its wait predicate)."""
        return (
            self.state in (State.CLOSED, State.PAUSING)
            or bool(self.aborts)
            or (self.state is State.RUNNING and bool(self.waiting or self.running or self.jobs))
        )

    def pause(self) -> None:
        if self.state is State.RUNNING:
            self.state = State.PAUSING

    def resume(self) -> None:
        if self.state is not State.CLOSED:
            self.state = State.RUNNING

    def close(self) -> None:
        self.state = State.CLOSED

    def schedule(self, keep: Callable[[list[int]], list[int]]) -> Step:
        """One step boundary. `keep(rows)`: the runner keeps those rows of its batch and returns which old row
        each slot now holds (`Slots.keep`)."""
        for req in self.aborts:
            req.finish = req.finish or FinishReason.ABORT  # one in a prefill leaves once its rows are merged
        self.aborts = []
        finished = [r for r in self.waiting + self.running if r.finish is not None]
        self.waiting = [r for r in self.waiting if r.finish is None]
        rows = [i for i, r in enumerate(self.running) if r.finish is None]
        if len(rows) < len(self.running):
            self.running = [self.running[i] for i in keep(rows)]
        if self.state is State.PAUSING:
            self.state = State.PAUSED
        if self.state is not State.RUNNING:
            return Step([], [], finished, run=False)
        free = max(self.max_rows - len(self.running) - sum(len(j.requests) for j in self.jobs), 0)
        new = self.waiting[:free]
        if self.running and 0 < len(new) < free and self._held < self.hold_steps:
            new, self._held = [], self._held + 1  # let arrivals gather (docs/internals.md)
        else:
            self._held = 0
        self.waiting = self.waiting[len(new) :]
        if not self.recompute:
            return Step(list(self.running), new, finished, run=bool(self.running or new or self.jobs))
        kept, self.recompute = self.drop(), False  # their keys/values are of the old weights
        finished += [r for r in kept if r.finish is not None]
        return Step([], [r for r in kept if r.finish is None] + new, finished, recompute=True)

    def plan(self, jobs: list[Prefill]) -> list[tuple[Prefill, int, int]]:
        """Queue new prefills; returns this step's chunks (job, first column, end column): oldest job first,
        `budget` tokens in all (a job gets budget // rows columns, at least one), a whole job only alone. A job
        whose last chunk this is joins the running batch now, in the order the runner merges its rows."""
        self.jobs += jobs
        chunks, used = [], 0
        for job in list(self.jobs):
            left = self.budget - used
            if used and (job.whole or left < job.rows):
                break
            end = job.columns if job.whole else min(job.columns, job.done + max(1, left // job.rows))
            chunks.append((job, job.done, end))
            used += job.rows * (end - job.done)
            job.done = end
            if end == job.columns:
                self.jobs.remove(job)
                self.running += job.requests
        return chunks

    def drop(self) -> list[Any]:
        """Empty the running batch and the prefills in progress (a refit, a failed step); their requests."""
        held = self.running + [r for job in self.jobs for r in job.requests]
        self.running, self.jobs = [], []
        return held
