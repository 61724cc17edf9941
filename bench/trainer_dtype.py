"""The trainer's step in bf16 against fp32 on this CPU (`--actor.dtype`: bf16 compute through FSDP2's mixed
precision, fp32 master weights and optimizer state).

SmolLM2-135M-Instruct, one `Actor.train_step` of `bench/padded_step.py`'s window, 8 rows of 128-1,024 tokens
(seeded random ids, a quarter prompt), after a warm-up step; each dtype in a process of its own (the trainer initialises its process group), the two
alternated `--rounds` times, `--steps` steps each; reported: the median step's process CPU seconds (the number
to compare on a shared machine) and wall seconds.

    .venv/bin/python bench/trainer_dtype.py [--rounds 2] [--steps 2] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def step_times(dtype: str, steps: int) -> dict[str, list[float]]:
    """In the worker process: one actor of `dtype`, its steps' CPU and wall seconds."""
    from padded_step import window  # beside this file: 8 rows of 128-1,024 seeded random tokens

    from molt.models import resolve_model
    from molt.trainer import Actor

    options = {"fsdp.device": "cpu", "train.share_prefix": False, "actor.adam.lr": 1e-6, "actor.dtype": dtype}
    actor = Actor.from_pretrained(str(resolve_model("smollm2-135m-instruct")), **options)
    exps = window(8, actor.model.lm.config.vocab_size)
    actor.train_step(exps)  # warm-up
    out: dict[str, list[float]] = {"cpu": [], "wall": []}
    for _ in range(steps):
        cpu, wall = time.process_time(), time.perf_counter()
        actor.train_step(exps)
        out["cpu"].append(time.process_time() - cpu)
        out["wall"].append(time.perf_counter() - wall)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--write", action="store_true", help="append the table to docs/benchmarks.md")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(step_times(args.worker, args.steps)))
        return
    times = {d: {"cpu": [], "wall": []} for d in ("float32", "bfloat16")}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for r in range(args.rounds):
        for d in times if r % 2 == 0 else reversed(times):
            cmd = [sys.executable, __file__, "--worker", d, "--steps", str(args.steps)]
            run = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            for k, v in json.loads(run.stdout.strip().splitlines()[-1]).items():
                times[d][k] += v
            print(d, times[d], flush=True)
    lines = ["| trainer dtype | CPU s a step | wall s a step |", "| --- | ---: | ---: |"]
    lines += [
        f"| {d} | {statistics.median(t['cpu']):.1f} | {statistics.median(t['wall']):.1f} |"
        for d, t in times.items()
    ]
    ratio = statistics.median(times["float32"]["cpu"]) / statistics.median(times["bfloat16"]["cpu"])
    note = (
        f"SmolLM2-135M-Instruct, 8 rows of 128-1,024 tokens, median of {args.rounds} x {args.steps} steps a dtype, "
        f"processes alternated: bf16 takes 1/{ratio:.2f} of fp32's CPU time. 2 threads, 1-min load average at the "
        f"end {os.getloadavg()[0]:.1f} (the machine was shared with other engineers' jobs). Not shown: that a "
        "bf16 trainer learns as well (the default stays float32 on a CPU)."
    )
    title = "The trainer's step, bf16 against fp32 on this CPU (`bench/trainer_dtype.py`)"
    print(f"{title}\n{note}\n\n" + "\n".join(lines))
    if args.write:
        cmd = ".venv/bin/python bench/trainer_dtype.py " + " ".join(a for a in sys.argv[1:] if a != "--write")
        with open(ROOT / "docs/benchmarks.md", "a") as f:
            f.write(f"\n## {title}\n\nCommand: `{cmd.strip()}`\n\n{note}\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
