"""The long agent session's experience through one training step of Molt's trainer (issue 37 item 6).

    .venv/bin/python bench/long_session_train.py --saved DIR [--configs default packed ...]

`bench/long_session.py --train` calls this after its session (and `--save DIR` keeps the model and the
experiences, so that the step can be measured again without the session). The session's segments (the ~32K
conversation and the title requests, each a prompt of the history so far) become experiences with the rollout's
advantage (1.0), and one `Actor.train_step` runs on them in-process, single rank, on the same tiny 32K-window
Llama, with `molt train`'s defaults except what a configuration overrides (`CONFIGS`).

Each configuration runs in a fresh child process (the peak is then the step's own, not a previous one's), with
glibc's mmap threshold fixed at 128 KiB (`MALLOC_MMAP_THRESHOLD_`) so that freed tensors leave the RSS and the
RSS follows the live tensors (as bench/trainer.py). After a warm-up step on the conversation's first 1,536
tokens (one-time costs and the optimizer's state out of the measurement), measured: the child's RSS before the
step (the Actor, the experiences, torch), its peak RSS over the step (VmHWM after resetting it with `/proc/self/clear_refs` = 5
just before the step; RSS, not torch's profiler: on the CPU every tensor is malloc'd memory and RSS also counts
what torch does not allocate itself), and the step's wall and CPU seconds (the process's, both torch threads).
The child's data segment is capped (`RLIMIT_DATA`, `--limit-gib`), so that a configuration whose attention
would not fit fails with an allocation error there instead of filling the shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> (what it shows, the overrides of `molt train`'s defaults)
CONFIGS = {
    "default": ("padded, 4,096-token budget (the defaults)", {}),
    "packed": ("packed, 4,096-token budget", {"fsdp.packing_samples": True}),
    "packed-64k": (
        "packed, 65,536-token budget",
        {"fsdp.packing_samples": True, "train.max_tokens_per_gpu": 65536},
    ),
    "packed-64k-ckpt": (
        "packed, 65,536, activation checkpointing",
        {"fsdp.packing_samples": True, "train.max_tokens_per_gpu": 65536, "actor.gradient_checkpoint": True},
    ),
    "padded-64k": ("padded, 65,536-token budget", {"train.max_tokens_per_gpu": 65536}),
    "unchunked": ("padded, 4,096, log-probs in one chunk", {"actor.logprob_chunk_size": 1 << 20}),
}


def save(directory: Path, model: str, experiences: list) -> Path:
    """Keep the session's model and experiences (payloads in place) for `--saved`."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "experiences.pkl", "wb") as f:
        pickle.dump({"model": model, "experiences": experiences}, f, protocol=5)
    return directory


def _status(key: str) -> float:
    """MiB of a /proc/self/status field (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(key + ":"))


def _head(e, n: int):
    """The experience's first `n` tokens (its first turns), as a small experience of the same shape."""
    from molt.types import Experience

    k = int(e.action_mask[:n].sum())
    return Experience(
        e.rollout_id,
        e.group_id,
        0,
        e.reward,
        min(n, e.num_tokens),
        k,
        e.min_version,
        e.temperature,
        e.token_ids[:n],
        e.action_mask[:n],
        e.behavior_logprobs[:k],
        e.versions[:k],
        advantages=e.advantages,
    )


def child(saved: Path, name: str) -> dict:
    """One training step under configuration `name`, in this (fresh) process."""
    from molt.trainer import Actor
    from molt.trainer.batching import plan_micro_batches

    with open(saved / "experiences.pkl", "rb") as f:
        data = pickle.load(f)
    experiences = data["experiences"]
    for e in experiences:
        e.advantages = 1.0  # the rollout's advantage on every action token, as a group estimator ships it
    actor = Actor.from_pretrained(data["model"], **{"fsdp.device": "cpu", **CONFIGS[name][1]})
    t = actor.cfg.train
    plan = plan_micro_batches(
        [e.num_tokens for e in experiences],
        t.micro_batch_size or None,
        t.max_tokens_per_gpu or None,
        packed=actor.cfg.fsdp.packing_samples,
    )
    actor.train_step([_head(experiences[0], 1536)])  # warm-up: one-time costs, the optimizer's state
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    c0, w0 = time.process_time(), time.perf_counter()
    metrics = actor.train_step(experiences)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    return {
        "loaded": before,
        "peak": _status("VmHWM"),
        "wall": wall,
        "cpu": cpu,
        "micro_batches": len(plan),
        "widest": max(
            sum(experiences[i].num_tokens for i in mb)
            if actor.cfg.fsdp.packing_samples
            else max(experiences[i].num_tokens for i in mb) * len(mb)
            for mb in plan
        ),
        "loss": metrics["policy_loss"],
        "grad_norm": metrics["actor_grad_norm"],
    }


def measure(saved: Path, names: list[str], limit_gib: float) -> dict[str, dict]:
    """Each configuration's step in its own child process; a failed child gives {"error": its last line}."""
    out = {}
    for name in names:
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONPATH": str(ROOT)}
        cmd = [
            sys.executable,
            __file__,
            "--saved",
            str(saved),
            "--child",
            name,
            "--limit-gib",
            str(limit_gib),
        ]
        # check=False: a configuration that does not fit is a row of the table, not the end of the bench
        run = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT, env=env)
        lines = (run.stdout.strip() or run.stderr.strip() or "no output").splitlines()
        out[name] = (
            json.loads(lines[-1])
            if run.returncode == 0
            else {"error": (run.stderr.strip().splitlines() or lines)[-1][:160]}
        )
        print(f"{name}: {out[name]}", flush=True)
    return out


def table(saved: Path, results: dict[str, dict]) -> str:
    with open(saved / "experiences.pkl", "rb") as f:
        experiences = pickle.load(f)["experiences"]
    lengths = sorted((e.num_tokens for e in experiences), reverse=True)
    head = (
        f"One training step on the session's {len(experiences)} experiences ({sum(lengths):,} tokens, the "
        f"longest {lengths[0]:,}, {sum(e.num_actions for e in experiences):,} action tokens):\n\n"
        "| configuration | micro-batches | widest (tokens) | RSS before (MiB) | peak RSS (MiB) | step peak - "
        "before (MiB) | step wall (s) | step CPU (s) |\n|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append(f"| {CONFIGS[name][0]} | | | | failed: {r['error']} | | | |")
            continue
        rows.append(
            f"| {CONFIGS[name][0]} | {r['micro_batches']} | {r['widest']:,} | {r['loaded']:.0f} | "
            f"{r['peak']:.0f} | +{r['peak'] - r['loaded']:.0f} | {r['wall']:.1f} | {r['cpu']:.1f} |"
        )
    return "\n".join([head, *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--saved", required=True, type=Path, help="a directory `long_session.py --save` wrote"
    )
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--limit-gib", type=float, default=8.0, help="the child's data-segment cap")
    parser.add_argument("--child", choices=list(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        cap = int(args.limit_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
        print(json.dumps(child(args.saved, args.child)))
        return
    print(table(args.saved, measure(args.saved, args.configs, args.limit_gib)))


if __name__ == "__main__":
    main()
