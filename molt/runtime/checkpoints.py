"""Where a run's checkpoints live, which of them are kept, and the skeleton every run loop shares around its steps.

A checkpoint is `<ckpt.path or output_dir/checkpoints>/step_N/` holding the trainer state (`trainer/`, DCP),
optionally the policy as a Hugging Face checkpoint (`hf/`, `ckpt.save_hf`), and `state.json`, written last, so
a directory without it is incomplete and ignored. `state.json` also keeps the metrics of its step, which is
what `ckpt.best_metric_key` ranks by.

Rotation (`ckpt.max_num` N > 0): after each save the complete checkpoints beyond the newest N are removed,
oldest first, except the newest one and the one with the highest `best_metric_key` value among those that have
it (the reference keeps its best checkpoint the same way).

`RunControl` is what `molt train` (molt.runtime.loop) and `molt sft` (molt.runtime.sft) share around their steps,
so the two cannot drift apart: when a checkpoint is due (every `ckpt.save_steps` steps, after a step ending
`ckpt.save_interval_s` or more after the last checkpoint, after the last step, and when the run stops), and
stopping: SIGINT/SIGTERM or a condition the loop finds fatal stop the run after the step in progress; the loop
checkpoints that step and `finish` raises `RunStopped` with the exit code (128 + the signal's number); a SIGINT
after that exits at once (Ctrl-C twice), a repeated SIGTERM changes nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from molt.runtime.pool import RunStopped

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunControl:
    def __init__(self, ckpt: Any, on_stop: Callable[[], None] = lambda: None):
        self.ckpt, self.on_stop = ckpt, on_stop  # on_stop: wakes the loop's waits (molt train's pool)
        self.root = Path(ckpt.path or Path(ckpt.output_dir) / "checkpoints")
        self.stopping: BaseException | None = None
        self.saved()

    def stop(self, reason: BaseException) -> None:
        """Stop after the step in progress with a checkpoint, then raise `reason` (the first reason wins)."""
        if self.stopping is None:
            self.stopping = getattr(reason, "cause", reason)  # a Ray actor's error carries the original
            self.on_stop()

    def skipped(self, in_a_row: float, limit: int) -> None:
        """Stop once `limit` optimizer steps in a row were skipped for a non-finite loss or gradient norm."""
        if in_a_row >= limit:
            self.stop(
                RunStopped(
                    f"{in_a_row:.0f} optimizer steps in a row were skipped for a non-finite loss or "
                    f"gradient norm (train.max_skipped_steps {limit}); the weights are those of the "
                    "last finite step"
                )
            )

    def _on_signal(self, signum: int, *_: Any) -> None:
        if self.stopping is not None:
            # SIGTERM again asks the same: a Slurm job's TERM reaches `molt train` directly and through its script
            if signum == signal.SIGINT:
                os._exit(128 + signum)
            return
        name = signal.Signals(signum).name
        print(
            f"molt: {name}: stopping after the step in progress with a checkpoint (SIGINT again: exit now)",
            file=sys.stderr,
        )
        self.stop(RunStopped(f"stopped by {name}", 128 + signum))

    @contextmanager
    def signals(self, loop: Any = None) -> Iterator[None]:
        """SIGINT/SIGTERM stop the run while inside (the main thread only; `loop`: an asyncio loop's handlers)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {sig: signal.getsignal(sig) for sig in SIGNALS}
        for sig in SIGNALS:
            if loop is not None:
                loop.add_signal_handler(sig, self._on_signal, sig)
            else:
                signal.signal(sig, self._on_signal)
        try:
            yield
        finally:
            for sig in SIGNALS:
                if loop is not None:
                    loop.remove_signal_handler(sig)
                else:
                    signal.signal(sig, old[sig])

    def due(self, step: int, last: bool = False) -> bool:
        """Whether a checkpoint is due after `step`."""
        c = self.ckpt  # save_steps: the reference's -1 is never
        return (
            last
            or self.stopping is not None
            or c.save_steps > 0
            and step % c.save_steps == 0
            or 0 < c.save_interval_s <= time.perf_counter() - self._saved
        )

    def saved(self) -> None:
        self._saved = time.perf_counter()

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step}"

    def checkpointed(self, step: int, state: dict[str, Any] | None) -> None:
        """Step `step`'s checkpoint is written but for `state.json`: write it, which marks the checkpoint
        complete, and rotate (`state` None: a rank that writes neither)."""
        if state is not None:
            (self.step_dir(step) / "state.json").write_text(json.dumps({"step": step, **state}))
            rotate(self.root, self.ckpt.max_num, self.ckpt.best_metric_key)
        self.saved()

    def finish(self, step: int) -> None:
        """After the last checkpoint: raise the stop's reason, if the run was stopped."""
        if self.stopping is not None:
            raise RunStopped(
                f"{self.stopping}; step {step} is checkpointed: run the same command again to resume",
                getattr(self.stopping, "exit_code", 1),
            )


def complete(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    found = [p for p in root.glob("step_*") if (p / "state.json").is_file()]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def resume_point(run_dir: Path, root: Path, resume: bool, config: dict | None = None) -> Path | None:
    """The checkpoint to resume from, if any. A run directory holds one run: one with a ledger but nothing to
    resume (or `ckpt.resume` off) is refused rather than appended to, unless it is this run (its saved
    config.yaml is `config`, the Ray section aside) stopped before its first checkpoint (a Slurm requeue in
    the first minutes): that one starts over in place."""
    ckpts = complete(root)
    ledger = run_dir / "ledger.jsonl"
    if ckpts and resume or not (ledger.is_file() and ledger.stat().st_size):
        return ckpts[-1] if ckpts and resume else None
    if not ckpts and config is not None and _same_run(run_dir / "config.yaml", config):
        print(
            f"molt: warning: {run_dir} holds this run (the same config.yaml), stopped before its first "
            "checkpoint: starting it over",
            file=sys.stderr,
        )
        for name in ("ledger.jsonl", "metrics.jsonl"):
            (run_dir / name).unlink(missing_ok=True)
        return None
    why = "ckpt.resume is off" if ckpts else f"no complete checkpoint under {root} to resume it"
    raise ValueError(
        f"ckpt.output_dir {run_dir} holds another run (ledger.jsonl) and {why}: pass a new "
        "ckpt.output_dir or remove the old run"
    )


def _same_run(saved: Path, config: dict) -> bool:
    import yaml

    if not saved.is_file():
        return False
    # through YAML as the saved one went (tuples become lists); where the run's processes run may change
    ours, theirs = yaml.safe_load(yaml.safe_dump(config)), yaml.safe_load(saved.read_text())
    return {**ours, "ray": None} == {**theirs, "ray": None}


def rotate(root: Path, max_num: int, best_metric_key: str = "") -> list[Path]:
    """Remove what `ckpt.max_num` does not keep (module docstring); returns the removed directories."""
    ckpts = complete(root)
    if max_num <= 0 or len(ckpts) <= max_num:
        return []
    keep = {ckpts[-1]}
    if best_metric_key:
        scores = {
            p: json.loads((p / "state.json").read_text()).get("metrics", {}).get(best_metric_key)
            for p in ckpts
        }
        ranked = [p for p in ckpts if scores[p] is not None]
        if ranked:
            keep.add(max(ranked, key=lambda p: scores[p]))
    removed = []
    for path in ckpts:
        if len(ckpts) - len(removed) <= max(max_num, len(keep)):
            break
        if path not in keep:
            shutil.rmtree(path)
            removed.append(path)
    return removed


def truncate_after(path: Path, step: int) -> None:
    """Drop the lines of a JSONL log whose step is after `step` (a resume redoes those steps)."""
    if path.is_file():
        lines = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
        path.write_text("".join(ln + "\n" for ln in lines))
