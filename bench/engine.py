"""Throughput of the embedded engine against padded `model.generate` (and, optionally, transformers'
continuous-batching manager) on the same prompts.

Workload: N concurrent requests (default 16) of exactly M new tokens (default 64; EOS is ignored through
min_tokens / min_new_tokens) at temperature 1 with no top-k/top-p, on SmolLM2-135M-Instruct in fp32.
Each variant runs once to warm up, then `--repeats` timed runs; the table reports the median and the best run.

    .venv/bin/python bench/engine.py [--model PATH] [--continuous-batching] [--write]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from molt.engine.hf import HFEngine
from molt.models import resolve_model
from molt.types import SamplingParams

QUESTIONS = [
    "What is 3 + 4?", "Name a primary colour.", "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.", "What is the capital of France?",
    "List three fruits.", "Translate 'good morning' into Spanish.", "Why is the sky blue?",
    "Give me a synonym for happy.", "How many legs does a spider have?",
    "Describe a cat to someone who has never seen one, in detail, including its habits and its sounds.",
    "What is 12 times 7?", "Suggest a name for a pet goldfish.", "What does CPU stand for?",
    "Write one sentence about autumn leaves falling in a quiet park.", "Is a tomato a fruit or a vegetable?",
]


def prompts_for(tokenizer, n: int) -> list[list[int]]:
    chats = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(n)]
    return [list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
            for c in chats]


def run_engine(engine: HFEngine, prompts: list[list[int]], new: int) -> int:
    params = SamplingParams(max_tokens=new, min_tokens=new, temperature=1.0)

    async def go() -> int:
        outs = await asyncio.gather(*[engine.generate(p, params) for p in prompts])
        return sum(len(o.token_ids) for o in outs)
    return asyncio.run(go())


def run_generate(model, prompts: list[list[int]], new: int, pad_id: int) -> int:
    length = max(map(len, prompts))
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as for any decoder-only batch
        ids[i, length - len(p):], mask[i, length - len(p):] = torch.tensor(p), 1
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=new, min_new_tokens=new, pad_token_id=pad_id)
    return (out.shape[1] - length) * len(prompts)


def start_continuous(model, new: int):
    """transformers' continuous-batching manager, started once (its start-up is not timed, as for the engine)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new,
                              eos_token_id=-1)
    manager = model.init_continuous_batching(
        generation_config=config, continuous_batching_config=ContinuousBatchingConfig(return_logprobs=True))
    manager.start()
    return manager


def run_continuous(manager, prompts: list[list[int]], new: int) -> int:
    ids = [manager.add_request(p, max_new_tokens=new, eos_token_id=-1) for p in prompts]  # -1: ignore EOS
    got = [manager.get_result(timeout=600) for _ in ids]
    assert all(g is not None and not g.error for g in got), "continuous batching failed"
    return sum(len(g.generated_tokens) for g in got)


def measure(variants: dict, repeats: int) -> dict[str, tuple[float, float]]:
    """Median and best tokens/s per variant. Rounds interleave the variants so that load from other
    processes on the shared cores hits them alike."""
    for fn in variants.values():
        fn()  # warm-up (allocator, kernels, thread pools)
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            tokens = fn()
            rates[name].append(tokens / (time.perf_counter() - start))
    return {name: (statistics.median(r), max(r)) for name, r in rates.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="checkpoint directory or model alias")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--continuous-batching", action="store_true", help="also time transformers' CB manager")
    ap.add_argument("--write", action="store_true", help="append the result table to docs/benchmarks.md")
    args = ap.parse_args()
    torch.manual_seed(0)
    model_path = str(resolve_model(args.model))
    engine = HFEngine(model_path, max_batch_size=max(args.requests, 1))
    model, tokenizer = engine.model, engine.tokenizer  # same weights for every variant
    prompts = prompts_for(tokenizer, args.requests)
    n, new = args.requests, args.new_tokens
    variants = {"embedded engine (molt.engine.hf)": lambda: run_engine(engine, prompts, new),
                "padded model.generate": lambda: run_generate(model, prompts, new, engine.pad_token_id)}
    manager = start_continuous(model, new) if args.continuous_batching else None
    if manager is not None:
        variants["transformers continuous batching"] = lambda: run_continuous(manager, prompts, new)
    rows = list(measure(variants, args.repeats).items())
    asyncio.run(engine.close())
    if manager is not None:
        manager.stop(block=True)
    base = rows[1][1][0]
    lines = [f"| variant | tokens/s (median of {args.repeats}) | best | vs padded generate |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {name} | {med:.1f} | {best:.1f} | {med / base:.2f}x |" for name, (med, best) in rows]
    table = "\n".join(lines)
    load = os.getloadavg()[0]
    context = (f"{n} requests x {new} new tokens, prompt lengths {min(map(len, prompts))}-{max(map(len, prompts))}, "
               f"fp32, temperature 1, {Path(model_path).name}, torch {torch.__version__}, "
               f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
               f"1-min load average at the end {load:.1f}")
    print(context + "\n\n" + table)
    if args.write:
        cmd = ".venv/bin/python bench/engine.py " + " ".join(a for a in sys.argv[1:] if a != "--write")
        with open(Path(__file__).resolve().parents[1] / "docs/benchmarks.md", "a") as f:
            f.write(f"\n## Embedded engine throughput (`bench/engine.py`)\n\nCommand: `{cmd}`\n\n{context}\n\n{table}\n")


if __name__ == "__main__":
    main()
