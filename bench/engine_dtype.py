"""The embedded engine alone in bf16 against fp32 on this CPU (`--rollout.dtype`, molt serve `--dtype`).

Two engines on SmolLM2-135M-Instruct in one process, alternated round by round (the cores are shared):
- decode: `--rows` concurrent requests of a chat prompt, exactly `--new-tokens` sampled tokens each, tokens/s;
- prefill: `--rows` requests of `--prefill-tokens` distinct tokens, one sampled token each, seconds;
- the behavior log-probs of each engine's decode against an fp32 forward over the same sequences (the gap that
  importance correction absorbs in training): mean and max |difference|.

    .venv/bin/python bench/engine_dtype.py [--rows 8] [--new-tokens 32] [--prefill-tokens 256] [--write]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from molt.engine.hf import HFEngine
from molt.models import resolve_model
from molt.types import SamplingParams


async def decode(engine: HFEngine, prompt: list[int], rows: int, new: int) -> tuple[float, list]:
    params = SamplingParams(max_tokens=new, min_tokens=new, temperature=1.0)
    start = time.perf_counter()
    outs = await asyncio.gather(*[engine.generate(prompt, params.copy(seed=i)) for i in range(rows)])
    return rows * new / (time.perf_counter() - start), outs


async def prefill(engine: HFEngine, prompts: list[list[int]]) -> float:
    start = time.perf_counter()
    await asyncio.gather(*[engine.generate(p, SamplingParams(max_tokens=1)) for p in prompts])
    return time.perf_counter() - start


@torch.no_grad()
def gaps(model, prompt: list[int], outs: list) -> list[float]:
    """|engine log-prob - fp32 forward log-prob| of every sampled token."""
    ids = torch.tensor([prompt + o.token_ids for o in outs])
    logp = torch.log_softmax(model(ids).logits[:, len(prompt) - 1 : -1].float(), -1)
    ref = logp.gather(2, ids[:, len(prompt) :, None])[..., 0]
    return (torch.tensor([o.logprobs for o in outs]) - ref).abs().flatten().tolist()


async def main(args: argparse.Namespace) -> tuple[str, str]:
    from transformers import AutoModelForCausalLM

    path = str(resolve_model(args.model))
    engines = {d: HFEngine(path, dtype=d, prefix_cache_mb=0) for d in ("float32", "bfloat16")}
    tok = engines["float32"].tokenizer
    chat = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
    prompt = list(tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=False))
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rates, times, diffs = {d: [] for d in engines}, {d: [] for d in engines}, {d: [] for d in engines}
    gen = torch.Generator().manual_seed(0)
    for e in engines.values():  # warm-up
        await decode(e, prompt, 2, 4)
    for r in range(args.repeats):
        prompts = [
            torch.randint(100, 40000, (args.prefill_tokens,), generator=gen).tolist()
            for _ in range(args.rows)
        ]
        for d, e in engines.items():
            rate, outs = await decode(e, prompt, args.rows, args.new_tokens)
            rates[d].append(rate)
            times[d].append(await prefill(e, prompts))
            diffs[d] += gaps(reference, prompt, outs)
    for e in engines.values():
        await e.close()
    lines = [
        "| engine dtype | decode tokens/s | prefill s | log-prob gap to fp32, mean | max |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for d in engines:
        lines.append(
            f"| {d} | {statistics.median(rates[d]):.1f} | {statistics.median(times[d]):.2f} | "
            f"{statistics.fmean(diffs[d]):.1e} | {max(diffs[d]):.1e} |"
        )
    rate = statistics.median(rates["bfloat16"]) / statistics.median(rates["float32"])
    speed = statistics.median(times["float32"]) / statistics.median(times["bfloat16"])
    note = (
        f"SmolLM2-135M-Instruct, {args.rows} concurrent requests: decode {args.new_tokens} sampled tokens each "
        f"(a chat prompt of {len(prompt)} tokens), prefill {args.prefill_tokens} tokens each (one sampled); "
        f"median of {args.repeats} alternated rounds. bf16 / fp32: decode {rate:.2f}x the tokens/s, prefill "
        f"{speed:.2f}x as fast. torch {torch.__version__}, {torch.get_num_threads()} threads, avx512_bf16 "
        f"{torch.cpu._is_avx512_bf16_supported()}, 1-min load average at the end {os.getloadavg()[0]:.1f} (the "
        "machine was shared with other engineers' tests: the ratios carry over, not the times)."
    )
    return note, "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prefill-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--write", action="store_true", help="append the table to docs/benchmarks.md")
    args = ap.parse_args()
    note, table = asyncio.run(main(args))
    title = "The embedded engine alone, bf16 against fp32 (`bench/engine_dtype.py`)"
    print(f"{title}\n{note}\n\n{table}")
    if args.write:
        cmd = ".venv/bin/python bench/engine_dtype.py " + " ".join(a for a in sys.argv[1:] if a != "--write")
        with open(Path(__file__).resolve().parents[1] / "docs/benchmarks.md", "a") as f:
            f.write(f"\n## {title}\n\nCommand: `{cmd}`\n\n{note}\n\n{table}\n")
