"""One cached session turn of the embedded engine against history length, beside what its attention alone costs.

    .venv/bin/python bench/session_turn.py [--histories 1700,8200,16300,31000] [--new 300] [--sampled 16]

In-process `HFEngine` on the tiny 32K-context Llama of `bench/long_session.py` (2 layers, 64 hidden, 4 query and
2 key/value heads of 16), one torch thread. Per history length: a session's context is prefilled cold, then three
turns each add `--new` tokens and sample `--sampled` (min_tokens = max_tokens); the median turn is reported as
CPU time of this process (steadier than wall time on a shared machine) and wall time. "attention" is the CPU time
of the same attention calls alone (`F.scaled_dot_product_attention` per layer: the new tokens over the history
with an additive mask, then one query per sampled token), the part of a turn that must grow with the history;
"rest" is the turn minus that.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from molt.engine.hf import HFEngine
from molt.testing.models import build_tiny_llama
from molt.types import SamplingParams


def attention_ms(context: int, new: int, sampled: int, layers: int = 2) -> float:
    """CPU ms of a turn's attention calls alone (median of 3): `new` queries over `context` keys (the last `new`
    of them causal), then one query per sampled token."""
    q, k = torch.randn(1, 4, new, 16), torch.randn(1, 2, context + sampled, 16)
    mask = torch.zeros(new, context)
    mask[:, context - new :] = torch.full((new, new), torch.finfo(torch.float32).min).triu(1)
    runs = []
    for _ in range(3):
        start = time.process_time()
        for _ in range(layers):
            F.scaled_dot_product_attention(
                q, k[:, :, :context], k[:, :, :context], attn_mask=mask, enable_gqa=True
            )
            for i in range(1, sampled):
                F.scaled_dot_product_attention(
                    q[:, :, :1], k[:, :, : context + i], k[:, :, : context + i], enable_gqa=True
                )
        runs.append(time.process_time() - start)
    return statistics.median(runs) * 1e3


async def run(args: argparse.Namespace) -> list[dict]:
    model = str(build_tiny_llama(Path(tempfile.mkdtemp()) / "tiny32k", max_positions=32768))
    engine = HFEngine(model)
    rng = random.Random(0)
    rows = []
    for history in args.histories:
        context = [
            rng.randrange(10, engine.vocab_size - 10) for _ in range(history - 3 * (args.new + args.sampled))
        ]
        done = await engine.generate(context, SamplingParams(max_tokens=1, seed=0), session_id=str(history))
        context += done.token_ids
        turns = []
        for _ in range(3):
            context += [rng.randrange(10, engine.vocab_size - 10) for _ in range(args.new)]
            cpu, wall = time.process_time(), time.perf_counter()
            done = await engine.generate(
                context,
                SamplingParams(max_tokens=args.sampled, min_tokens=args.sampled, seed=0),
                session_id=str(history),
            )
            turns.append((time.process_time() - cpu, time.perf_counter() - wall, len(context)))
            context += done.token_ids
        cpu, wall, length = (statistics.median(t[i] for t in turns) for i in range(3))
        rows.append(
            {
                "history": int(length),
                "cpu": cpu * 1e3,
                "wall": wall * 1e3,
                "attention": attention_ms(int(length), args.new, args.sampled),
            }
        )
    await engine.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--histories", default="1700,8200,16300,31000")
    parser.add_argument("--new", type=int, default=300)
    parser.add_argument("--sampled", type=int, default=16)
    args = parser.parse_args()
    args.histories = [int(h) for h in args.histories.split(",")]
    torch.set_num_threads(1)
    rows = asyncio.run(run(args))
    print("| prompt (tokens) | turn CPU (ms) | turn wall (ms) | attention alone, CPU (ms) | rest (ms) |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['history']:,} | {r['cpu']:.0f} | {r['wall']:.0f} | {r['attention']:.0f} | "
            f"{r['cpu'] - r['attention']:.0f} |"
        )


if __name__ == "__main__":
    main()
