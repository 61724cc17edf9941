"""The embedded engine's host time per decode step: what is left of a step when the model costs nothing.

On a GPU with CUDA graphs a decode step is one graph replay (a few milliseconds of kernels at 256 rows for a 0.5B
model) plus the host's own work around it: scheduling, slot bookkeeping, sampling's small tensors, the per-request
Python of `_emit`. That host part bounds tokens/s at rows / host time whatever the GPU does, and it can be measured
here: a model of 2 layers of width 64 and a vocabulary of `--vocab` (512: its forward and sampling take little), the
padded decode path that CUDA graphs replay (run eagerly on the CPU), each request's min_tokens in force (as in
`bench/engine.py`). Each forward is timed: host = decode step - its forward, the prefills set apart.

    .venv/bin/python bench/engine_host.py [--rows 64,256] [--new-tokens 64] [--repeats 3] [--write]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.engine import random_qwen_05b
from molt.engine.hf import HFEngine
from molt.engine.runner import ModelRunner
from molt.engine.slots import GraphDecoder
from molt.types import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,256", help="concurrent requests, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--write", action="store_true", help="append the table to docs/benchmarks.md")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the rollout worker's setting on a busy host
    spent = {"decode": 0.0, "prefill": 0.0, "steps": 0}  # seconds inside the model's forwards; decode steps

    def timing(real, kind):
        def wrapper(*a, **k):
            start = time.perf_counter()
            out = real(*a, **k)
            spent[kind] += time.perf_counter() - start
            spent["steps"] += kind == "decode"
            return out

        return wrapper

    GraphDecoder._forward = timing(GraphDecoder._forward, "decode")
    ModelRunner._forward = timing(
        ModelRunner._forward, "prefill"
    )  # prefills (decode goes through the graph path)
    scratch = tempfile.TemporaryDirectory()
    engine = HFEngine(random_qwen_05b(Path(scratch.name), tiny=True, vocab=args.vocab), max_batch_size=256)
    engine.runner.graphs, engine.scheduler.hold_steps = (
        True,
        8,
    )  # the CUDA path's padded decode, without capture
    params = SamplingParams(max_tokens=args.new_tokens, min_tokens=args.new_tokens, temperature=1.0)
    lines = [
        "| rows | decode step ms | of which forward ms | host ms | rows / host (tokens/s ceiling) | prefill s |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n in map(int, args.rows.split(",")):
        prompts = [[2 + (i * 7 + j) % (args.vocab - 2) for j in range(34 + i % 18)] for i in range(n)]

        async def go(prompts=prompts):
            return await asyncio.gather(
                *[engine.generate(p, params.copy(seed=i)) for i, p in enumerate(prompts)]
            )

        asyncio.run(go())  # warm-up
        runs = []
        for _ in range(args.repeats):
            spent.update(decode=0.0, prefill=0.0, steps=0)
            start = time.perf_counter()
            asyncio.run(go())
            wall = time.perf_counter() - start
            runs.append(
                (
                    (wall - spent["prefill"]) / spent["steps"],
                    spent["decode"] / spent["steps"],
                    spent["prefill"],
                )
            )
        step, fwd, prefill = (statistics.median(r[i] for r in runs) for i in range(3))
        lines.append(
            f"| {n} | {1e3 * step:.1f} | {1e3 * fwd:.1f} | {1e3 * (step - fwd):.1f} | "
            f"{n / (step - fwd):,.0f} | {prefill:.2f} |"
        )
    asyncio.run(engine.close())
    table = "\n".join(lines)
    context = (
        f"{args.new_tokens} new tokens per request (min_tokens too), vocabulary {args.vocab}, median of "
        f"{args.repeats}; a decode step's time is the run's wall time less its prefill forwards, per decode "
        f"forward; torch {torch.__version__}, "
        f"1 thread"
    )
    print(f"{context}\n\n{table}")
    if args.write:
        cmd = ".venv/bin/python bench/engine_host.py " + " ".join(a for a in sys.argv[1:] if a != "--write")
        with open(Path(__file__).resolve().parents[1] / "docs/benchmarks.md", "a") as f:
            f.write(
                f"\n## The engine's host time per decode step (`bench/engine_host.py`)\n\nCommand: `{cmd}`\n\n"
                f"{context}\n\n{table}\n"
            )


if __name__ == "__main__":
    main()
