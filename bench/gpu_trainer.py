"""Benchmark: one `Actor.train_step` against a plain Hugging Face training loop on the same window.

Workload (defaults, issue 11): a randomly initialised Qwen2.5-0.5B-shaped model (hidden 896, 24 layers, 14 heads,
2 KV heads, intermediate 4864, vocabulary 151,936, tied embeddings), a window of 64 sequences x 512 tokens: 8
groups of 8 sharing a 128-token prompt, 384 action tokens each, micro-batches of 8,192 tokens.

Variants, each timed in this process after a warm-up step (`--repeats` steps, the mean and the fastest reported):
- molt-packed: `Actor` with `packing_samples` (one packed row per micro-batch, varlen attention);
- molt-padded: `Actor` with padded micro-batches (either with `:N`: log-prob chunks of N rows, default 512);
- molt-packed-lora: molt-packed training LoRA adapters of rank 16 on every attention and MLP projection (its
  MFU still counts 6 x parameters per token, though the frozen base computes no weight gradients);
- plain: fp32 master weights, bf16 autocast, full logits, fp32 log_softmax, fused AdamW, padded micro-batches
  of the same token budget (the loop a researcher would write first).
MFU = 6 x parameters x tokens / step time / peak (`--peak-tflops`, 989 for an H200's dense bf16). Peak memory is
`torch.cuda.max_memory_allocated` during the timed steps. On CPU (`--tiny`, a small shape) it checks that the
bench runs; its times say nothing about a GPU.

    python bench/gpu_trainer.py [--tiny] [--repeats 3] [--variants molt-packed molt-padded plain] [--write]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHAPE = {
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151936,
}
TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
}


def build_model(path: Path, shape: dict) -> int:
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(**shape, tie_word_embeddings=True, max_position_embeddings=4096, torch_dtype="float32")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def make_window(args, vocab: int) -> list:
    from windows import experience  # beside this file

    rng = random.Random(0)
    out = []
    for g in range(args.sequences // args.group):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt)]
        for i in range(args.group):
            reply = [rng.randrange(vocab) for _ in range(args.seq_len - args.prompt)]
            advantages = [0.0] * args.prompt + [rng.gauss(0, 1) for _ in reply]
            out.append(experience(f"r{g}-{i}", f"g{g}", prompt, reply, advantages, behavior=0.0))
    return out


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def molt_step(args, path, window, pack: bool, chunk: int, lora: int = 0):
    from molt.trainer import Actor

    actor = Actor.from_pretrained(
        str(path),
        **{
            "actor.lora_rank": lora,
            "actor.lora_alpha": 2 * lora,
            "actor.adam.lr": 1e-6,
            "train.max_tokens_per_gpu": args.budget,
            "fsdp.packing_samples": pack,
            "actor.logprob_chunk_size": chunk,
            "train.share_prefix": False,
            "algo.advantage.is_correction_level": "token",
            "algo.advantage.is_correction_mode": "trunc",
            "algo.advantage.is_correction_threshold": (0.0, 2.0),
        },
    )
    for e, lp in zip(window, actor.compute_logprobs(window)):  # behavior log-probs near the trainer's
        e.behavior_logprobs = lp[e.action_mask]  # one per action token (molt.types)
    return lambda: actor.train_step(window), actor.device


def plain_step(args, path, window):
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).train()
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-6, fused=device.type == "cuda")
    rows = max(1, args.budget // args.seq_len)
    ids = torch.tensor(np.stack([e.token_ids for e in window]), device=device, dtype=torch.long)
    mask = torch.tensor(np.stack([e.action_mask for e in window]), device=device, dtype=torch.float32)
    adv = torch.tensor(np.stack([e.advantages for e in window]), device=device)
    count = mask.sum()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def step():
        for s in range(0, len(window), rows):
            with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
                logits = lm(input_ids=ids[s : s + rows]).logits
            logp = torch.log_softmax(logits.float(), -1)[:, :-1]
            lp = logp.gather(-1, ids[s : s + rows, 1:, None])[..., 0]
            (-(lp * adv[s : s + rows, 1:] * mask[s : s + rows, 1:]).sum() / count).backward()
        torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, device


def measure(step, device, repeats: int) -> dict:
    step()  # warm-up (allocator, kernels, lazy optimizer state)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return {"mean_s": sum(times) / len(times), "best_s": min(times), "peak_gib": peak}


def profile_step(step, device, name: str) -> None:
    """Print one more step's kernels by device time (CPU ops on a CPU), and its host syncs: where a missed goal's
    time goes, in the same run (printed only)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step()
        sync(device)
    events = prof.key_averages()
    key = "device_time_total" if cuda else "self_cpu_time_total"
    syncs = sum(e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize"))
    print(
        f"{name}: one step's kernels by {key}; {syncs} stream or device synchronizations\n"
        + events.table(sort_by=key, row_limit=20, max_name_column_width=70),
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="a small shape on CPU: checks that the bench runs")
    p.add_argument("--sequences", type=int, default=64)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--budget", type=int, default=8192, help="tokens per micro-batch")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--variants",
        nargs="+",
        default=["molt-packed", "molt-packed:2048", "molt-padded", "plain", "molt-packed-lora"],
        help="molt-packed, molt-padded (optionally -lora: LoRA rank 16, docs/lora.md; optionally :CHUNK, "
        "the log-prob chunk size; 512), plain",
    )
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--write", action="store_true", help="append the table to docs/benchmarks.md")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    if args.tiny:
        args.sequences, args.seq_len, args.prompt, args.budget = 8, 64, 16, 256
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        n_params = build_model(Path(tmp), TINY if args.tiny else SHAPE)
        vocab = (TINY if args.tiny else SHAPE)["vocab_size"]
        failed = {}  # variant -> error: one variant's crash (an OOM, a kernel) keeps the others' numbers
        for variant in args.variants:
            window = make_window(args, vocab)
            try:
                if variant == "plain":
                    step, device = plain_step(args, tmp, window)
                else:
                    name, _, chunk = variant.partition(":")
                    lora = 16 if name.endswith("-lora") else 0
                    step, device = molt_step(
                        args,
                        tmp,
                        window,
                        pack=name.removesuffix("-lora") == "molt-packed",
                        chunk=int(chunk or 512),
                        lora=lora,
                    )
                r = measure(step, device, args.repeats)
            except Exception as e:  # noqa: BLE001 - reported and counted in the exit code
                failed[variant] = f"{type(e).__name__}: {e}"
                print(f"{variant} FAILED: {failed[variant]}", flush=True)
                step = device = None
            else:
                tokens = args.sequences * args.seq_len
                r["tokens_per_s"] = tokens / r["best_s"]
                r["mfu"] = 6 * n_params * tokens / r["best_s"] / (args.peak_tflops * 1e12)
                results[variant] = r
                print(f"{variant}: {r}", flush=True)  # a run cut short by a time limit keeps these
                try:
                    if variant == args.variants[0]:
                        profile_step(step, device, variant)
                except Exception as e:  # noqa: BLE001 - a diagnosis only: the measurement stands
                    print(f"{variant}: the profile failed: {type(e).__name__}: {e}", flush=True)
            del step
            gc.collect()  # the previous variant's model and optimizer state leave the GPU before the next loads
            try:
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            except RuntimeError as e:  # a kernel fault is sticky: no later variant can run; keep what ran
                failed.setdefault(variant, f"{type(e).__name__}: {e}")
                break
    base = results.get("plain", {}).get("best_s")
    lines = [
        "| variant | best step s | mean step s | tokens/s | MFU | peak GiB | time vs plain |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for v, r in results.items():
        ratio = f"{r['best_s'] / base:.2f}x" if base else "-"
        lines.append(
            f"| {v} | {r['best_s']:.3f} | {r['mean_s']:.3f} | {r['tokens_per_s']:,.0f} | "
            f"{100 * r['mfu']:.1f}% | {r['peak_gib']:.1f} | {ratio} |"
        )
    lines += [f"| {v} | failed: {err[:200].replace('|', '/')} | | | | | |" for v, err in failed.items()]
    table = "\n".join(lines)
    print(table)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else "CPU"
    if args.json:
        Path(args.json).write_text(
            json.dumps({"device": device, "params": n_params, "results": results, "failed": failed}, indent=1)
        )
    if args.write:
        cmd = "python bench/gpu_trainer.py " + " ".join(sys.argv[1:])
        when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        with open(ROOT / "docs" / "benchmarks.md", "a") as f:
            f.write(
                f"\n## Trainer step on {device} (`bench/gpu_trainer.py`)\n\nCommand: `{cmd}` ({when}, "
                f"torch {torch.__version__}, {n_params / 1e6:.0f}M parameters, {args.sequences} x {args.seq_len} "
                f"tokens, micro-batches of {args.budget} tokens).\n\n{table}\n"
            )
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
