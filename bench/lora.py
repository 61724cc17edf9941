"""Benchmark: LoRA against full fine-tuning of the same model in the trainer (molt.trainer.Actor): peak memory,
optimizer state bytes, refit bytes and seconds per optimizer step.

Each variant runs in a fresh subprocess (so the peaks do not mix): it builds the actor, takes one warm-up step and
then `--steps` timed steps on the same window of `--batch` sequences of `--seq` tokens (half prompt, half action,
random advantages), and streams one refit (`Actor.iter_weights`, what the engine receives, in the refit dtype).
Peak memory: CUDA's max allocated on a GPU; on a CPU the process's RSS high-water mark above the RSS after
building the actor (the weights themselves do not count, the step's gradients, optimizer state and activations
do). Time: the median step over `--rounds` runs of each variant, interleaved (full, LoRA, full, ...), CPU seconds of
the process on a CPU (this machine's cores are shared) and wall. Refit bytes: what `Actor.iter_weights` sends the
embedded engine (with LoRA the adapters) and vLLM (with LoRA the merged targeted modules).
`--engine`: what holding the adapters costs the embedded engine's decode instead (`engine_cost`).

    .venv/bin/python bench/lora.py [--model smollm2-135m-instruct] [--rank 16] [--batch 8] [--seq 256]
                                   [--device cpu] [--rounds 1] [--threads 0] [--json out.json]
    .venv/bin/python bench/lora.py --engine [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rss(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def run_variant(a) -> dict:
    import torch

    from molt.models import resolve_model
    from molt.trainer import Actor
    from molt.types import Experience

    if a.threads:
        torch.set_num_threads(a.threads)
    path = str(resolve_model(a.model))
    over = {
        "fsdp.device": a.device,
        "actor.adam.lr": 1e-5,
        "actor.gradient_checkpoint": True,
        "train.max_tokens_per_gpu": 0,
        **({"actor.lora_rank": a.rank, "actor.lora_alpha": 2 * a.rank} if a.rank else {}),
    }
    actor = Actor.from_pretrained(path, **over)
    rng, vocab = random.Random(0), actor.lm.config.vocab_size
    half = a.seq // 2
    window = [
        Experience(
            f"r{i}",
            "g",
            0,
            0.0,
            a.seq,
            a.seq - half,
            0,
            token_ids=[rng.randrange(vocab) for _ in range(a.seq)],
            action_mask=[0] * half + [1] * (a.seq - half),
            behavior_logprobs=[0.0] * half + [-2.0] * (a.seq - half),
            advantages=[0.0] * half + [rng.gauss(0, 1) for _ in range(a.seq - half)],
        )
        for i in range(a.batch)
    ]
    actor.train_step(window)  # warm-up: allocates the optimizer state
    cuda = actor.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    base = torch.cuda.memory_allocated() if cuda else _rss("VmRSS")
    cpu, wall = [], []
    for _ in range(a.steps):
        c0, w0 = time.process_time(), time.perf_counter()
        actor.train_step(window)
        if cuda:
            torch.cuda.synchronize()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    peak = (torch.cuda.max_memory_allocated() if cuda else _rss("VmHWM")) - base
    state = [t for o in actor.optimizers for s in o.state.values() for t in s.values() if torch.is_tensor(t)]
    dtype, refit = torch.bfloat16 if cuda else None, {}
    for engine in ("hf", "vllm"):  # the embedded engine gets the adapters, vLLM the merged modules
        actor.cfg.rollout.engine, t0 = engine, time.perf_counter()
        refit[engine] = sum(
            t.numel() * t.element_size() for b in actor.iter_weights(dtype=dtype) for _, t in b
        )
        refit[f"{engine}_s"] = time.perf_counter() - t0
    return {
        "variant": f"lora r={a.rank}" if a.rank else "full",
        "peak_step_bytes": peak,
        "optimizer_state_bytes": sum(t.numel() * t.element_size() for t in state),
        "trainable_params": sum(p.numel() for p in actor.model.parameters() if p.requires_grad),
        "refit_bytes": refit["hf"],
        "refit_bytes_vllm": refit["vllm"],
        "refit_gather_s": refit["hf_s"],
        "step_cpu_s": cpu,
        "step_wall_s": wall,
    }


def engine_cost(a) -> None:
    """The embedded engine's decode with the adapters it holds under LoRA against the plain base model: 16
    concurrent requests of 32 tokens, `--rounds` interleaved rounds, medians."""
    import asyncio

    import torch

    from molt.config import OptimConfig
    from molt.engine.hf import HFEngine
    from molt.models import resolve_model
    from molt.types import SamplingParams

    if a.threads:
        torch.set_num_threads(a.threads)
    path, lora = (
        str(resolve_model(a.model)),
        OptimConfig(lora_rank=a.rank, lora_alpha=2 * a.rank).lora_options(),
    )

    async def run(engine) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        await asyncio.gather(
            *[
                engine.generate([1, 2, 3 + i, 4], SamplingParams(max_tokens=32, min_tokens=32, seed=i))
                for i in range(16)
            ]
        )
        return time.perf_counter() - t0, time.process_time() - c0

    async def rounds() -> None:
        engines = {
            "base": HFEngine(path, prefix_cache_mb=0),
            f"lora r={a.rank}": HFEngine(path, prefix_cache_mb=0, lora=lora),
        }
        times: dict[str, list] = {k: [] for k in engines}
        for i in range(a.rounds + 1):  # the first round warms up
            for k, e in engines.items():
                times[k] += [await run(e)] if i else []
        print("| engine | decode tokens/s (wall) | CPU s per 512 tokens |\n| --- | --- | --- |")
        for k, v in times.items():
            print(
                f"| {k} | {512 / statistics.median(w for w, _ in v):.1f} | {statistics.median(c for _, c in v):.2f} |"
            )
        await asyncio.gather(*[e.close() for e in engines.values()])

    asyncio.run(rounds())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank of the LoRA variant")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--rounds", type=int, default=1, help="runs of each variant, interleaved (step times: median)"
    )
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--threads", type=int, default=0, help="torch threads of each variant (0: torch's default)"
    )
    p.add_argument("--json", default="")
    p.add_argument("--variant", action="store_true", help=argparse.SUPPRESS)  # one variant, in this process
    p.add_argument(
        "--engine", action="store_true", help="the embedded engine's decode with and without adapters"
    )
    a = p.parse_args()
    if a.engine:
        engine_cost(a)
        return
    if a.variant:
        print(json.dumps(run_variant(a)))
        return
    runs: dict[int, list[dict]] = {0: [], a.rank: []}
    for _ in range(
        a.rounds
    ):  # interleaved: a loaded machine's load changes between rounds, not between variants
        for rank, done in runs.items():
            args = [
                sys.executable,
                __file__,
                "--variant",
                "--rank",
                str(rank),
                "--model",
                a.model,
                "--batch",
                str(a.batch),
                "--seq",
                str(a.seq),
                "--steps",
                str(a.steps),
                "--device",
                a.device,
                "--threads",
                str(a.threads),
            ]
            out = subprocess.run(args, check=True, capture_output=True, text=True, cwd=ROOT).stdout
            done.append(json.loads(out.strip().splitlines()[-1]))
    rows = [
        {**r[0], **{k: statistics.median(t for x in r for t in x[k]) for k in ("step_cpu_s", "step_wall_s")}}
        for r in runs.values()
    ]
    full = rows[0]
    print(
        "| variant | peak step memory | optimizer state | trainable params | refit bytes (embedded) | refit bytes "
        "(vLLM) | step (CPU s) | step (wall s) |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    for r in rows:
        share = {
            k: r[k] / full[k]
            for k in (
                "peak_step_bytes",
                "optimizer_state_bytes",
                "refit_bytes",
                "refit_bytes_vllm",
                "step_cpu_s",
                "step_wall_s",
            )
        }
        print(
            f"| {r['variant']} | {r['peak_step_bytes'] / 2**20:.0f} MiB ({share['peak_step_bytes']:.0%}) | "
            f"{r['optimizer_state_bytes'] / 2**20:.1f} MiB ({share['optimizer_state_bytes']:.1%}) | "
            f"{r['trainable_params'] / 1e6:.2f} M | {r['refit_bytes'] / 2**20:.1f} MiB ({share['refit_bytes']:.1%}) "
            f"| {r['refit_bytes_vllm'] / 2**20:.0f} MiB ({share['refit_bytes_vllm']:.0%}) "
            f"| {r['step_cpu_s']:.2f} ({share['step_cpu_s']:.2f}x) | {r['step_wall_s']:.2f} ({share['step_wall_s']:.2f}x) |"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
