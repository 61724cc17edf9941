"""Asynchrony and experience storage benchmarks (issue 6). Prints tables; `--write` appends them to
docs/benchmarks.md with this command.

1. Wall time of N updates when agents wait a random tool latency (seeded, mean comparable to a train step):
   synchronous (max_staleness 0) against asynchronous with staleness 1 and 2, on a small real Llama (random
   weights, built locally), real Ray workers, capture server and FSDP trainer rank.
2. Controller peak memory while it passes one step of experiences carrying 1 MB and 10 MB image payloads per
   rollout to a trainer rank: offloaded (references only, the Molt path) against gathered centrally (payloads
   returned inline to the controller). Producer and consumer are Ray actors; the controller's peak RSS is
   measured with psutil while it handles 32 rollouts.
"""
import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def time_updates(steps: int, latency: float) -> list[tuple[str, float, float, float]]:
    import ray

    from molt.config import MoltConfig, validate
    from molt.runtime.loop import run_training
    from molt.runtime.metrics import read_metrics
    from molt.testing.models import build_tiny_llama

    os.environ["MOLT_BENCH_TOOL_LATENCY"] = str(latency)
    tmp = Path(tempfile.mkdtemp())
    model = build_tiny_llama(tmp / "model", hidden_size=256, num_layers=4)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"MOLT_BENCH_TOOL_LATENCY": str(latency), "TOKENIZERS_PARALLELISM": "false"}})
    rows = []
    for staleness in (0, 1, 2):
        cfg = MoltConfig()
        cfg.actor.model_name_or_path = str(model)
        cfg.train.agent_path = str(ROOT / "bench/agents/latency_env.py")
        cfg.data.prompt_dataset = str(ROOT / "recipes/math/data/single_train.jsonl")
        cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt, cfg.rollout.max_new_tokens = 2, 4, 16
        cfg.train.max_steps, cfg.train.max_staleness, cfg.train.seed = steps, staleness, 0
        cfg.ckpt.output_dir = str(tmp / f"run-s{staleness}")
        summary = asyncio.run(run_training(validate(cfg)))
        train_s = np.mean([m["timing/policy_train"] for m in read_metrics(cfg.ckpt.output_dir)])
        rows.append((f"staleness {staleness}" + (" (sync)" if staleness == 0 else ""), summary["train_seconds"],
                     summary["train_seconds"] / steps, float(train_s)))
    ray.shutdown()
    return rows


def controller_memory(mb: int, offload: bool, rollouts: int = 32) -> float:
    """Peak controller RSS growth (MB) while one step's experiences travel from producers to a trainer rank."""
    import ray

    from molt.runtime.experience import assign_to_ranks, outcome_from_trajectory
    from molt.types import Segment, Trajectory

    @ray.remote(num_cpus=0)
    class Producer:
        def make(self, i):
            seg = Segment(list(range(256)), [1] * 256, [-0.5] * 256, [0] * 256,
                          images=np.full(mb << 20, i % 251, dtype=np.uint8))
            return outcome_from_trajectory(Trajectory(f"r{i}", "g", [seg]), offload=offload)

    @ray.remote(num_cpus=0)
    class Rank:
        def consume(self, exps):
            return sum(int(e.reload().images[0]) if e.offloaded else int(e.images[0]) for e in exps)

    producers, rank = [Producer.remote() for _ in range(4)], Rank.remote()
    ray.get([p.make.remote(0) for p in producers])  # warm up the actors
    proc = psutil.Process()
    base = peak = proc.memory_info().rss
    stop = threading.Event()

    def sample():
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, proc.memory_info().rss)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    outcomes = ray.get([producers[i % 4].make.remote(i) for i in range(rollouts)])
    exps = [e for o in outcomes for e in o.experiences]
    total = ray.get(rank.consume.remote(assign_to_ranks(exps, 1)[0]))
    stop.set()
    sampler.join()
    assert total == sum(i % 251 for i in range(rollouts))
    del outcomes, exps
    return (peak - base) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--latency", type=float, default=1.0, help="mean tool latency in seconds")
    parser.add_argument("--write", action="store_true", help="append the tables to docs/benchmarks.md")
    args = parser.parse_args()

    import ray

    timing = time_updates(args.steps, args.latency)
    sync = timing[0][1]
    lines = [f"### Asynchrony: {args.steps} updates, tool latency {args.latency} s x U[0.5, 1.5]", "",
             "| mode | wall s | s/update | train step s (mean) | speed-up vs sync |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {wall:.1f} | {per:.2f} | {train:.2f} | {sync / wall:.2f}x |"
              for name, wall, per, train in timing]
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    mem = {(mb, off): controller_memory(mb, off) for mb in (1, 10) for off in (True, False)}
    ray.shutdown()
    lines += ["", "### Controller peak memory growth for 32 rollouts, one step", "",
              "| payload per rollout | offloaded (refs) MB | gathered centrally MB |", "|---|---|---|"]
    lines += [f"| {mb} MB | {mem[(mb, True)]:.1f} | {mem[(mb, False)]:.1f} |" for mb in (1, 10)]
    table = "\n".join(lines)
    print(table)
    if args.write:
        cmd = "python bench/async.py " + " ".join(sys.argv[1:])
        with open(ROOT / "docs/benchmarks.md", "a") as f:
            f.write(f"\n## bench/async.py\n\nCommand: `{cmd}` ({time.strftime('%Y-%m-%d')}, 2-core CPU)\n\n{table}\n")


if __name__ == "__main__":
    main()
