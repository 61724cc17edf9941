"""The object-store refit path: a trainer's weights into Ray's object store and out into an engine's model.

Compares buckets of pickled tensors (how they travelled before) with `molt.engine.base.pack_weights` (each
tensor's bytes as a numpy array, which Ray stores out of band and returns as a view of its buffer). Measures, per
refit of the whole model in 64 MiB buckets: "put" (the trainer's `iter_weight_buckets` + `ray.put`) and "fetch
and copy" (`ray.get` + `unpack_weights` + `copy_weights` into a second copy of the model's state dict), both in one
process with one torch thread, alternating the two ways; the median of `--repeats` rounds after one warm-up.

    .venv/bin/python bench/refit.py [--model smollm2-135m-instruct] [--repeats 5] [--write]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from molt.engine.base import copy_weights, pack_weights, unpack_weights
from molt.models import resolve_model
from molt.trainer.weights import iter_weight_buckets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--write", action="store_true", help="append the table to docs/benchmarks.md")
    args = ap.parse_args()
    import ray
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    ray.init("local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    path = str(resolve_model(args.model))
    lm = AutoModelForCausalLM.from_pretrained(path)
    target = AutoModelForCausalLM.from_pretrained(path).state_dict()
    ways = {"pickled tensors": lambda b: b, "packed (`pack_weights`)": pack_weights}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    for _ in range(args.repeats + 1):
        for name, pack in ways.items():
            t0 = time.perf_counter()
            refs = [ray.put(pack(bucket)) for bucket in iter_weight_buckets(lm, 64 << 20)]
            t1 = time.perf_counter()
            for ref in refs:
                copy_weights(target, unpack_weights(ray.get(ref)), args.model)
            times[name].append((t1 - t0, time.perf_counter() - t1))
            del refs
    ray.shutdown()
    n_bytes = sum(
        t.numel() * t.element_size() for _, t in (p for b in iter_weight_buckets(lm, 64 << 20) for p in b)
    )
    lines = ["| way | put s | fetch and copy s | total s |", "| --- | ---: | ---: | ---: |"]
    for name, rows in times.items():
        put, fetch = (statistics.median(r[i] for r in rows[1:]) for i in (0, 1))
        lines.append(f"| {name} | {put:.3f} | {fetch:.3f} | {put + fetch:.3f} |")
    context = (
        f"{args.model}, {n_bytes / 2**20:.0f} MiB in 64 MiB buckets, one process, 1 torch thread, median of "
        f"{args.repeats} rounds after a warm-up; torch {torch.__version__}, ray {ray.__version__}"
    )
    table = "\n".join(lines)
    print(f"{context}\n\n{table}")
    if args.write:
        cmd = ".venv/bin/python bench/refit.py " + " ".join(a for a in sys.argv[1:] if a != "--write")
        with open(Path(__file__).resolve().parents[1] / "docs/benchmarks.md", "a") as f:
            f.write(
                f"\n## Refit through the object store (`bench/refit.py`)\n\nCommand: `{cmd}`\n\n{context}\n\n{table}\n"
            )


if __name__ == "__main__":
    main()
