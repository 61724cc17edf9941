"""Where a run's checkpoints live and which of them are kept.

A checkpoint is `<ckpt.path or output_dir/checkpoints>/step_N/` holding the trainer state (`trainer/`, DCP),
optionally the policy as a Hugging Face checkpoint (`hf/`, `ckpt.save_hf`), and `state.json`, written last, so
a directory without it is incomplete and ignored. `state.json` also keeps the metrics of its step, which is
what `ckpt.best_metric_key` ranks by.

Rotation (`ckpt.max_num` N > 0): after each save the complete checkpoints beyond the newest N are removed,
oldest first, except the newest one and the one with the highest `best_metric_key` value among those that have
it (the reference keeps its best checkpoint the same way).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path


def complete(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    found = [p for p in root.glob("step_*") if (p / "state.json").is_file()]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def resume_point(run_dir: Path, root: Path, resume: bool) -> Path | None:
    """The checkpoint to resume from, if any. A run directory holds one run: one with a ledger but nothing to
    resume (or `ckpt.resume` off) is refused rather than appended to."""
    ckpts = complete(root)
    ledger = run_dir / "ledger.jsonl"
    if ckpts and resume or not (ledger.is_file() and ledger.stat().st_size):
        return ckpts[-1] if ckpts and resume else None
    why = "ckpt.resume is off" if ckpts else f"no complete checkpoint under {root} to resume it"
    raise ValueError(f"ckpt.output_dir {run_dir} holds another run (ledger.jsonl) and {why}: pass a new "
                     "ckpt.output_dir or remove the old run")


def rotate(root: Path, max_num: int, best_metric_key: str = "") -> list[Path]:
    """Remove what `ckpt.max_num` does not keep (module docstring); returns the removed directories."""
    ckpts = complete(root)
    if max_num <= 0 or len(ckpts) <= max_num:
        return []
    keep = {ckpts[-1]}
    if best_metric_key:
        scores = {p: json.loads((p / "state.json").read_text()).get("metrics", {}).get(best_metric_key)
                  for p in ckpts}
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
