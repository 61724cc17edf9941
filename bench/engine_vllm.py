"""`bench/engine.py --engine vllm`: the vLLM engine (molt.engine.vllm on vLLM's CPU build, `make vllm`) side by side
with the embedded engine (molt.engine.hf), on SmolLM2-135M-Instruct in fp32 on this CPU, under the same conditions:
both engines live in one process and one event loop, and every measurement alternates between them.

- Start-up: from the constructor to the first token of a one-token request (vLLM: its engine core process, the
  model load, compilation unless `--eager`, the KV cache; embedded: the model load, in process).
- Throughput: N concurrent requests (default 64 and 256) of exactly M new tokens (default 64), temperature 1, no
  top-k/top-p, as `bench/engine.py`; the median and the best of `--repeats` alternated rounds.
- Multi-turn: `bench/engine.py --multi-turn`'s workload (S sessions, each a `--history`-token prompt, then per
  turn `--new-tokens` sampled and a `--user-tokens` message appended; the whole history resent). The embedded
  engine's prefix cache and vLLM's automatic prefix caching both find the shared blocks by a hash of the prefix.

    .venv-vllm/bin/python bench/engine.py --engine vllm [--requests 64,256] [--sessions 1] [--eager] [--write]
    .venv-vllm/bin/python bench/engine.py --engine vllm --multi-turn [--turns 6] [--write]   # start-up, multi-turn
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

from molt.types import SamplingParams


async def started(make) -> tuple[object, float]:
    """(engine, seconds from construction to its first sampled token)."""
    start = time.perf_counter()
    engine = await asyncio.to_thread(make)
    await engine.generate([1, 2, 3], SamplingParams(max_tokens=1))
    return engine, time.perf_counter() - start


async def batch(engine, prompts: list[list[int]], new: int) -> float:
    """Tokens per second of one round of concurrent requests."""
    params = SamplingParams(max_tokens=new, min_tokens=new, temperature=1.0)
    start = time.perf_counter()
    outs = await asyncio.gather(*[engine.generate(p, params) for p in prompts])
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


async def sessions(engine, starts: list[list[int]], user: list[int], turns: int, new: int, tag: str) -> float:
    """Seconds of a multi-turn run (every session's turns, all sessions concurrent)."""
    prompts, start = [list(p) for p in starts], time.perf_counter()
    for k in range(turns):
        params = SamplingParams(max_tokens=new, min_tokens=new, temperature=1.0, seed=k)
        outs = await asyncio.gather(
            *[engine.generate(p, params, f"{tag}-{i}") for i, p in enumerate(prompts)]
        )
        prompts = [p + o.token_ids + user for p, o in zip(prompts, outs)]
    return time.perf_counter() - start


async def side_by_side(
    args: argparse.Namespace, model_path: str, prompts_for, questions: list[str]
) -> list[tuple]:
    from molt.engine.hf import HFEngine
    from molt.engine.vllm import VLLMEngine

    makers = {
        "embedded (molt.engine.hf)": lambda: HFEngine(model_path, max_batch_size=256, prefix_cache_mb=1024),
        "vLLM (molt.engine.vllm)": lambda: VLLMEngine(
            model_path, max_model_len=4096, enforce_eager=args.eager
        ),
    }
    engines, tables = {}, []
    for name, make in makers.items():  # one after the other: a start-up alone on the machine's cores
        engines[name], seconds = await started(make)
        print(f"  {name}: started in {seconds:.1f} s", flush=True)
        tables.append(("start-up", name, seconds, seconds))
    try:
        tokenizer = engines[next(iter(engines))].tokenizer
        new = args.new_tokens or 64
        for n in [] if args.multi_turn else map(int, (args.requests or "64,256").split(",")):
            prompts = prompts_for(tokenizer, n)
            rates = {name: [] for name in engines}
            for name, engine in engines.items():
                await batch(engine, prompts[:8], 4)  # warm-up
            for _ in range(args.repeats or 2):
                for name, engine in engines.items():
                    rates[name].append(await batch(engine, prompts, new))
                    print(f"  {n} requests, {name}: {rates[name][-1]:.1f} tokens/s", flush=True)
            tables += [
                (f"{n} requests x {new} tokens, tokens/s", name, statistics.median(r), max(r))
                for name, r in rates.items()
            ]
        n, turns, new = args.sessions, args.turns, args.new_tokens or 32
        stream = tokenizer.encode(
            " ".join(questions) * ((args.history + 97 * n + args.user_tokens) // 200 + 1)
        )
        starts, user = [stream[97 * i : 97 * i + args.history] for i in range(n)], stream[-args.user_tokens :]
        times = {name: [] for name in engines}
        for r in range(args.repeats or 2):
            for name, engine in engines.items():
                times[name].append(await sessions(engine, starts, user, turns, new, f"r{r}"))
                print(f"  multi-turn, {name}: {times[name][-1]:.1f} s", flush=True)
        what = (
            f"multi-turn: {n} session(s) x {turns} turns, {args.history}-token history, +{new} sampled "
            f"+{args.user_tokens} per turn, seconds"
        )
        tables += [(what, name, statistics.median(t), min(t)) for name, t in times.items()]
    finally:
        for engine in engines.values():
            await engine.close()
    return tables


def main(args: argparse.Namespace, model_path: str, prompts_for, questions: list[str], report) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rows = asyncio.run(side_by_side(args, model_path, prompts_for, questions))
    lines = ["| measure | engine | median | best |", "| --- | --- | ---: | ---: |"]
    lines += [f"| {what} | {name} | {med:.1f} | {best:.1f} |" for what, name, med, best in rows]
    import vllm

    context = (
        f"{Path(model_path).name}, fp32, temperature 1; vLLM {vllm.__version__} "
        f"({'eager' if args.eager else 'compiled, its default'}), one process and event loop for both, "
        f"rounds alternated; 1-min load average at the end {os.getloadavg()[0]:.1f}"
    )
    report(
        "The vLLM engine beside the embedded engine on this CPU (`bench/engine.py --engine vllm`)",
        context,
        "\n".join(lines),
    )
