"""Asynchrony and experience storage benchmarks (issue 6). Prints tables; `--write` appends them to
docs/benchmarks.md with this command.

1. Wall time of N updates when agents wait a random tool latency (seeded, mean comparable to a train step):
   synchronous (max_staleness 0) against asynchronous with staleness 1 and 2, on a small real Llama (random
   weights, built locally), real Ray workers, capture server and FSDP trainer rank.
2. Controller peak memory while it passes one step of experiences to a trainer rank: offloaded (references
   only, the Molt path) against gathered centrally (payloads returned inline to the controller). Payloads: 1 MB
   and 10 MB byte arrays per rollout, and real image payloads: two desktop-like 1280x720 screenshots per
   rollout (an agent's two turns) through Qwen2-VL's image processor with its released size limits, i.e. the
   `Segment.images` the capture server records (pixel_values [4784 patches, 1176] fp32 and image_grid_thw per
   screenshot, 43 MB a rollout; each producer processes four distinct rollouts' screenshots and copies them for
   the rest). Producers and the consumer are Ray actors; the controller's peak RSS is measured with psutil
   while it handles 32 rollouts (`--image-rollouts` for the screenshots). `--memory-only` skips part 1.
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

    from molt.config import MoltConfig
    from molt.config_validate import validate
    from molt.runtime.loop import run_training
    from molt.runtime.metrics import read_metrics
    from molt.testing.models import build_tiny_llama

    os.environ["MOLT_BENCH_TOOL_LATENCY"] = str(latency)
    tmp = Path(tempfile.mkdtemp())
    model = build_tiny_llama(tmp / "model", hidden_size=256, num_layers=4)
    ray.init(
        "local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            "env_vars": {"MOLT_BENCH_TOOL_LATENCY": str(latency), "TOKENIZERS_PARALLELISM": "false"}
        },
    )
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
        rows.append(
            (
                f"staleness {staleness}" + (" (sync)" if staleness == 0 else ""),
                summary["train_seconds"],
                summary["train_seconds"] / steps,
                float(train_s),
            )
        )
    ray.shutdown()
    return rows


def screenshots(i: int, n: int = 2) -> dict:
    """Processor inputs of n desktop-like 1280x720 screenshots (windows, title bars, text), Qwen2-VL's image
    processor (PIL backend) with the size limits of the released Qwen2-VL-7B-Instruct."""
    from PIL import Image, ImageDraw
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    shots = []
    for k in range(n):
        im = Image.new("RGB", (1280, 720), (40, 90 + i % 100, 160))
        draw = ImageDraw.Draw(im)
        for w in range(6):
            x, y = 60 + 170 * w, 40 + 90 * ((w + k) % 4)
            draw.rectangle((x, y, x + 420, y + 300), fill=(240, 240, 235), outline="black")
            draw.rectangle((x, y, x + 420, y + 24), fill=(70, 70, 90))
            for line in range(12):
                draw.text(
                    (x + 10, y + 34 + 21 * line), f"rollout {i} turn {k} window {w} line {line}", fill="black"
                )
        shots.append(im)
    out = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056)(shots, return_tensors="pt")
    return {k: v for k, v in out.items()}


def nbytes(images) -> int:
    return sum(v.nbytes for v in images.values()) if isinstance(images, dict) else images.nbytes


def controller_memory(mb: int, offload: bool, rollouts: int = 32) -> float:
    """Peak controller RSS growth (MB) while one step's experiences travel from producers to a trainer rank;
    mb = 0: two real screenshots per rollout (`screenshots`)."""
    import ray

    from molt.runtime.experience import assign_to_ranks, outcome_from_trajectory
    from molt.types import Segment, Trajectory

    @ray.remote(num_cpus=0)
    class Producer:
        def __init__(self):
            self.shots = {}

        def make(self, i):
            if mb == 0 and i % 4 not in self.shots:
                self.shots[i % 4] = screenshots(i % 4)
            images = (
                {k: v.clone() for k, v in self.shots[i % 4].items()}
                if mb == 0
                else np.full(mb << 20, i % 251, dtype=np.uint8)
            )
            seg = Segment(list(range(256)), [1] * 256, [-0.5] * 256, [0] * 256, images=images)
            out = outcome_from_trajectory(Trajectory(f"r{i}", "g", [seg]))
            for e in out.experiences if offload else []:
                e.payload_ref = ray.put(e.split())
            return out

    @ray.remote(num_cpus=0)
    class Rank:
        def consume(self, exps):  # every byte of every payload reached the rank
            return sum(nbytes((e.reload() if e.offloaded else e).images) for e in exps)

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
    assert total == rollouts * nbytes(screenshots(0) if mb == 0 else np.zeros(mb << 20, dtype=np.uint8))
    del outcomes, exps
    return (peak - base) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--latency", type=float, default=1.0, help="mean tool latency in seconds")
    parser.add_argument("--write", action="store_true", help="append the tables to docs/benchmarks.md")
    parser.add_argument("--memory-only", action="store_true", help="skip the asynchrony timing (part 1)")
    parser.add_argument("--image-rollouts", type=int, default=32, help="rollouts of the screenshot payload")
    args = parser.parse_args()

    import ray

    lines = []
    if not args.memory_only:
        timing = time_updates(args.steps, args.latency)
        sync = timing[0][1]
        lines = [
            f"### Asynchrony: {args.steps} updates, tool latency {args.latency} s x U[0.5, 1.5]",
            "",
            "| mode | wall s | s/update | train step s (mean) | speed-up vs sync |",
            "|---|---|---|---|---|",
            "",
        ]
        lines[-1:] = [
            f"| {name} | {wall:.1f} | {per:.2f} | {train:.2f} | {sync / wall:.2f}x |"
            for name, wall, per, train in timing
        ] + [""]
    ray.init("local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    sizes = {1: 32, 10: 32, 0: args.image_rollouts}  # mb -> rollouts (0: the screenshots)
    mem = {(mb, off): controller_memory(mb, off, n) for mb, n in sizes.items() for off in (True, False)}
    ray.shutdown()
    shot_mb = nbytes(screenshots(0)) / 2**20
    names = {
        1: "1 MB bytes",
        10: "10 MB bytes",
        0: f"2 screenshots 1280x720, Qwen2-VL inputs ({shot_mb:.0f} MB)",
    }
    lines += [
        "### Controller peak memory growth for one step",
        "",
        "| payload per rollout | rollouts | offloaded (refs) MB | gathered centrally MB |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {names[mb]} | {n} | {mem[(mb, True)]:.1f} | {mem[(mb, False)]:.1f} |" for mb, n in sizes.items()
    ]
    table = "\n".join(lines)
    print(table)
    if args.write:
        cmd = "python bench/async.py " + " ".join(sys.argv[1:])
        with open(ROOT / "docs/benchmarks.md", "a") as f:
            f.write(
                f"\n## bench/async.py\n\nCommand: `{cmd}` ({time.strftime('%Y-%m-%d')}, 2-core CPU)\n\n{table}\n"
            )


if __name__ == "__main__":
    main()
