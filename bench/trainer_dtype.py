"""The trainer's step in bf16 against fp32 on this CPU (`--actor.dtype`: bf16 compute through FSDP2's mixed
precision, fp32 master weights and optimizer state), on one of two windows:

- `--window padded` (the default): `bench/padded_step.py`'s window, 8 rows of 128-1,024 tokens (seeded random
  ids, a quarter prompt), padded rows, no prefix sharing, the run's torch threads;
- `--window vs-trl`: `bench/vs_trl.py`'s shape, 2 prompt groups x 8 replies, a 45-token prompt shared by each
  group (packed once, `train.share_prefix`), replies of 10-30 seeded random tokens, `--fsdp.packing_samples`,
  one torch thread (a run gives the trainer one of the two cores): where the trainer's time goes when sequences
  are short.

SmolLM2-135M-Instruct, one `Actor.train_step` after a warm-up step; each dtype in a process of its own (the
trainer initialises its process group), the two alternated `--rounds` times, `--steps` steps each; reported: the
median step's process CPU seconds (the number to compare on a shared machine) and wall seconds. The molt the
workers import is `PYTHONPATH`'s when it is set (to compare code, run it from another tree), else this tree's.

    .venv/bin/python bench/trainer_dtype.py [--window padded|vs-trl] [--rounds 2] [--steps 2] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


PROMPT, GROUPS, GROUP = 45, 2, 8  # the vs-TRL window


def vs_trl_window(vocab: int) -> list:
    from windows import experience  # beside this file

    rng, out = random.Random(0), []
    for g in range(GROUPS):
        prompt = [rng.randrange(10, vocab) for _ in range(PROMPT)]
        for i in range(GROUP):
            reply = [rng.randrange(10, vocab) for _ in range(rng.randint(10, 30))]
            out.append(experience(f"r{g}.{i}", f"g{g}", prompt, reply, rng.gauss(0.0, 1.0)))
    return out


def step_times(dtype: str, steps: int, window: str) -> dict[str, list[float]]:
    """In the worker process: one actor of `dtype` on `window`, its steps' CPU and wall seconds."""
    import torch
    from padded_step import window as padded_window  # beside this file

    from molt.models import resolve_model
    from molt.trainer import Actor

    options = {"fsdp.device": "cpu", "actor.adam.lr": 1e-6, "actor.dtype": dtype}
    if window == "vs-trl":
        torch.set_num_threads(1)
        options["fsdp.packing_samples"] = True
    else:
        options["train.share_prefix"] = False
    actor = Actor.from_pretrained(str(resolve_model("smollm2-135m-instruct")), **options)
    vocab = actor.model.lm.config.vocab_size
    exps = vs_trl_window(vocab) if window == "vs-trl" else padded_window(8, vocab)
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
    ap.add_argument("--window", choices=("padded", "vs-trl"), default="padded")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--write", action="store_true", help="append the table to docs/benchmarks.md")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(step_times(args.worker, args.steps, args.window)))
        return
    times = {d: {"cpu": [], "wall": []} for d in ("float32", "bfloat16")}
    tree = os.environ.get("PYTHONPATH", str(ROOT))
    env = {**os.environ, "PYTHONPATH": tree}
    worker = [sys.executable, __file__, "--steps", str(args.steps), "--window", args.window]
    for r in range(args.rounds):
        for d in times if r % 2 == 0 else reversed(times):
            cmd = [*worker, "--worker", d]
            run = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            for k, v in json.loads(run.stdout.strip().splitlines()[-1]).items():
                times[d][k] += v
            print(d, times[d], flush=True)
    lines = ["| trainer dtype | CPU s a step | wall s a step |", "| --- | ---: | ---: |"]
    lines += [
        f"| {d} | {statistics.median(t['cpu']):.2f} | {statistics.median(t['wall']):.2f} |"
        for d, t in times.items()
    ]
    ratio = statistics.median(times["float32"]["cpu"]) / statistics.median(times["bfloat16"]["cpu"])
    shape = {
        "padded": "8 padded rows of 128-1,024 tokens, the run's torch threads",
        "vs-trl": "the vs-TRL window (2 groups x 8 replies of 10-30 tokens, packed), 1 torch thread",
    }[args.window]
    note = (
        f"SmolLM2-135M-Instruct, {shape}, median of {args.rounds} x {args.steps} steps a dtype, processes "
        f"alternated: bf16 takes 1/{ratio:.2f} of fp32's CPU time. Code from {tree}; 1-min load average at the "
        f"end {os.getloadavg()[0]:.1f}."
    )
    title = f"The trainer's step, bf16 against fp32 on this CPU, the {args.window} window (`bench/trainer_dtype.py`)"
    print(f"{title}\n{note}\n\n" + "\n".join(lines))
    if args.write:
        cmd = ".venv/bin/python bench/trainer_dtype.py " + " ".join(a for a in sys.argv[1:] if a != "--write")
        with open(ROOT / "docs/benchmarks.md", "a") as f:
            f.write(f"\n## {title}\n\nCommand: `{cmd.strip()}`\n\n{note}\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
