"""Reading a run from outside, as the tests of whole runs do: its JSONL files, its processes, and acting on an
event of a run in flight rather than after a fixed sleep."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import psutil


def jsonl(path: str | Path) -> list[dict]:
    """The records of a JSONL file ([] while it does not exist yet)."""
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def descendants(root: int, marker: str = "spawn_main") -> list[int]:
    """The pids among `root`'s descendants whose command line holds `marker` (the embedded engines' spawned
    processes by default; "ray::RolloutWorker" for the worker actors): no other process here is ever touched."""
    found = []
    for p in psutil.Process(root).children(recursive=True):
        try:
            if marker in " ".join(p.cmdline()):
                found.append(p.pid)
        except psutil.Error:
            pass
    return found


def gone(pid: int) -> bool:
    """Whether `pid` has exited (a zombie counts: its parent has not reaped it yet)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def when(predicate: Callable[[], bool], then: Callable[[], object], *, poll: float = 0.2) -> threading.Event:
    """Run `then()` on a thread as soon as `predicate()` holds (an event, not a deadline); set the returned
    event to stop watching."""
    stop = threading.Event()

    def watch():
        while not stop.wait(poll):
            if predicate():
                then()
                return

    threading.Thread(target=watch, daemon=True).start()
    return stop


def check_exactly_once(out: str | Path, steps: int, groups_per_step: int = 2) -> None:
    """The run in `out` trained every step once, each with its groups, and no group or rollout twice."""
    rows = jsonl(Path(out) / "ledger.jsonl")
    keys = [tuple(r["key"]) for r in rows]
    assert len(keys) == steps * groups_per_step and len(set(keys)) == len(keys)  # none twice, none missing
    assert sorted(r["step"] for r in rows) == sorted(list(range(1, steps + 1)) * groups_per_step)
    metric_steps = [m["step"] for m in jsonl(Path(out) / "metrics.jsonl")]
    assert sorted(s for s in metric_steps if s > 0) == list(range(1, steps + 1))
    rollouts = [rid for r in rows for rid in r["rollouts"]]
    assert len(rollouts) == len(set(rollouts))  # no rollout trained twice
