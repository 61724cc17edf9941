"""The trainer's step on the vs-TRL window (`bench/vs_trl.py`'s shape), fp32 and bf16, one thread: where the
trainer's time goes when sequences are short.

SmolLM2-135M-Instruct, 2 prompt groups x 8 replies: a 45-token prompt shared by each group (packed once,
`train.share_prefix`), replies of 10-30 seeded random tokens, `--fsdp.packing_samples`; one `Actor.train_step`
after a warm-up, median of `--steps`; each dtype in a process of its own, torch threads 1 (a run gives the
trainer one of the two cores). To compare code, run it from another tree with `PYTHONPATH=<tree>`.

    .venv/bin/python bench/rl_step.py [--steps 3] [--write]
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
PROMPT, GROUPS, GROUP = 45, 2, 8


def window(vocab: int) -> list:
    from molt.types import Experience

    rng, out = random.Random(0), []
    for g in range(GROUPS):
        prompt = [rng.randrange(10, vocab) for _ in range(PROMPT)]
        for i in range(GROUP):
            n = rng.randint(10, 30)
            out.append(
                Experience(
                    rollout_id=f"r{g}.{i}",
                    group_id=f"g{g}",
                    segment_index=0,
                    reward=0.0,
                    num_tokens=PROMPT + n,
                    num_actions=n,
                    min_version=0,
                    token_ids=prompt + [rng.randrange(10, vocab) for _ in range(n)],
                    action_mask=[0] * PROMPT + [1] * n,
                    behavior_logprobs=[-8.0] * n,
                    versions=[0] * n,
                    advantages=rng.gauss(0.0, 1.0),
                )
            )
    return out


def step_seconds(dtype: str, steps: int) -> list[float]:
    """In the worker process: one packed actor of `dtype`, its steps' wall seconds."""
    import torch

    from molt.models import resolve_model
    from molt.trainer import Actor

    torch.set_num_threads(1)
    options = {
        "fsdp.device": "cpu",
        "fsdp.packing_samples": True,
        "actor.adam.lr": 1e-6,
        "actor.dtype": dtype,
    }
    actor = Actor.from_pretrained(str(resolve_model("smollm2-135m-instruct")), **options)
    exps = window(actor.model.lm.config.vocab_size)
    actor.train_step(exps)  # warm-up
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        actor.train_step(exps)
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--write", action="store_true", help="append the table to docs/benchmarks.md")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(step_seconds(args.worker, args.steps)))
        return
    tree = os.environ.get("PYTHONPATH", str(ROOT))
    lines = ["| trainer dtype | s a step (median) | steps |", "| --- | ---: | --- |"]
    for dtype in ("float32", "bfloat16"):
        cmd = [sys.executable, __file__, "--worker", dtype, "--steps", str(args.steps)]
        run = subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": tree}, check=True
        )
        times = json.loads(run.stdout.strip().splitlines()[-1])
        lines.append(f"| {dtype} | {statistics.median(times):.2f} | {', '.join(f'{t:.2f}' for t in times)} |")
        print(lines[-1], flush=True)
    note = f"Code from {tree}; 1-min load average at the end {os.getloadavg()[0]:.1f}."
    print("\n".join(lines) + "\n" + note)
    if args.write:
        cmd = ".venv/bin/python bench/rl_step.py " + " ".join(a for a in sys.argv[1:] if a != "--write")
        with open(ROOT / "docs/benchmarks.md", "a") as f:
            f.write(
                f"\n## The trainer's step on the vs-TRL window (`bench/rl_step.py`)\n\nCommand: `{cmd}`\n\n"
            )
            f.write(note + "\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
