"""Benchmark: one policy update (`Actor.train_step`) on a GRPO-shaped window, padded or packed
(`packing_samples`), with and without shared prefixes.

The window is what the math recipe trains on: G prompts x N samples, every sample of a prompt starting with the
same P context tokens, replies of U[lo, hi] tokens, random tokens and advantages (the cost does not depend on
the values). Each (threads, layout, share_prefix) runs in a fresh process: one warm-up step, then `--repeats`
steps; the table gives the fastest step in wall seconds and the mean, and the speed-up over padded without
sharing. Also checks that every variant gives the same log-probs for the window (max difference printed).

    .venv/bin/python bench/shared_prefix.py [--model PATH] [--prompts 2] [--samples 8] [--prompt-len 38]
        [--reply 10 48] [--threads 1 2] [--repeats 3] [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def window(args, vocab: int):
    from windows import experience  # beside this file

    rng = random.Random(0)
    out = []
    for g in range(args.prompts):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
        for i in range(args.samples):
            reply = [rng.randrange(vocab) for _ in range(rng.randint(*args.reply))]
            mask = [0] * len(prompt) + [1] * len(reply)
            advantages = [rng.gauss(0, 1) * m for m in mask]
            out.append(experience(f"{g}-{i}", str(g), prompt, reply, advantages, behavior=-1.0))
    return out


def worker(args, threads: int, share: bool, pack: bool) -> dict:
    import torch

    from molt.trainer import Actor

    torch.set_num_threads(threads)
    actor = Actor.from_pretrained(
        args.model, **{"actor.adam.lr": 1e-6, "train.share_prefix": share, "fsdp.packing_samples": pack}
    )
    exps = window(args, actor.lm.config.vocab_size)
    actor.train_step(exps)  # warm-up
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        actor.train_step(exps)
        times.append(time.perf_counter() - t0)
    lp = actor.compute_logprobs(exps[: args.samples])
    return {
        "min": min(times),
        "mean": sum(times) / len(times),
        "logprobs": lp,
        "tokens": sum(len(e.token_ids) for e in exps),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model", default=None, help="HF checkpoint dir (default: resolve smollm2-135m-instruct)"
    )
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument(
        "--prompt-len", type=int, default=38, help="context tokens per prompt (the math recipe: ~38)"
    )
    ap.add_argument("--reply", type=int, nargs=2, default=[10, 48])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--write-docs", action="store_true", help="append the table to docs/benchmarks.md")
    ap.add_argument("--worker", nargs=3, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        from molt.models import resolve_model

        args.model = resolve_model("smollm2-135m-instruct")
    if args.worker:
        print(json.dumps(worker(args, args.worker[0], bool(args.worker[1]), bool(args.worker[2]))))
        return
    variants = [(0, 0), (0, 1), (1, 0), (1, 1)]  # (pack, share)
    rows, lines = (
        [],
        [
            "| torch threads | layout | share_prefix | fastest step s | mean step s | speed-up |",
            "|---|---|---|---:|---:|---:|",
        ],
    )
    for threads in args.threads:
        res = {}
        for pack, share in variants:
            cmd = [
                sys.executable,
                __file__,
                *sys.argv[1:],
                "--model",
                str(args.model),
                "--worker",
                str(threads),
                str(share),
                str(pack),
            ]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            res[pack, share] = json.loads(out.strip().splitlines()[-1])
        base = res[0, 0]
        rows.append(
            max(
                abs(a - b)
                for r in res.values()
                for r0, r1 in zip(base["logprobs"], r["logprobs"])
                for a, b in zip(r0, r1)
            )
        )
        for (pack, share), r in res.items():
            lines.append(
                f"| {threads} | {'packed' if pack else 'padded'} | {bool(share)} | {r['min']:.2f} | "
                f"{r['mean']:.2f} | {base['min'] / r['min']:.2f}x |"
            )
    cmd = "python bench/shared_prefix.py " + " ".join(a for a in sys.argv[1:] if a != "--write-docs")
    head = (
        f"Command: `{cmd.strip()}` ({time.strftime('%Y-%m-%d')}, {platform.machine()}); window "
        f"{args.prompts} prompts x {args.samples} samples, {args.prompt_len} prompt tokens, replies "
        f"U{args.reply}, {base['tokens']} tokens; largest log-prob difference between variants: {max(rows):.1e}"
    )
    table = "\n".join([head, "", *lines])
    print(table)
    if args.write_docs:
        with open(ROOT / "docs" / "benchmarks.md", "a") as f:
            f.write(
                "\n## Padded, packed and shared prefixes in the policy update (`bench/shared_prefix.py`)\n\n"
                + table
                + "\n"
            )


if __name__ == "__main__":
    main()
