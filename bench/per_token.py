"""Host-side cost of per-token data between capture and the trainer (issue 37 item 2): the payload's pickled bytes
per token, its pickle round trip (what Ray does to it), and collation into a micro-batch (padded, and packed with
the group's shared prompt), for a group of long segments.

    .venv/bin/python bench/per_token.py [--samples 8] [--tokens 16384] [--actions 0.1] [--repeat 15]

It uses only the public records (`Segment`, `Experience`) and `collate`, built from Python lists as an agent's
data would be, so it runs unchanged on an older tree: `git archive <rev> | tar -x -C /tmp/old` and
`PYTHONPATH=/tmp/old python bench/per_token.py` (run from this tree) measures that revision (docs/benchmarks.md).
Times are the best of `--repeat` runs.
"""

from __future__ import annotations

import argparse
import pickle
import random
import time


def best_ms(f, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=8, help="segments of one prompt group")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per segment")
    parser.add_argument("--actions", type=float, default=0.1, help="fraction of sampled tokens (at the end)")
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    import torch

    import molt
    from molt.trainer.batching import collate
    from molt.types import Experience, Segment, Trajectory

    rng, n = random.Random(0), args.tokens
    k = int(n * args.actions)
    prompt = [rng.randrange(50000) for _ in range(n - k)]
    exps = []
    for i in range(args.samples):
        mask = [0] * (n - k) + [1] * k
        segment = Segment(
            prompt + [rng.randrange(50000) for _ in range(k)],
            mask,
            [-1.0 * m for m in mask],
            [3 if m else -1 for m in mask],
        )
        exps.append(Experience.from_segment(Trajectory(f"r{i}", "g", [segment], reward=float(i % 2)), 0))
    payloads = [e.split() for e in exps]
    size = sum(len(pickle.dumps(p, protocol=5)) for p in payloads)
    round_trip = best_ms(lambda: [pickle.loads(pickle.dumps(p, protocol=5)) for p in payloads], args.repeat)
    for e, p in zip(exps, payloads):
        for name, value in p.items():
            setattr(e, name, value)
    cpu = torch.device(
        "cpu"
    )  # advantages left out (zeros): how a tree holds them differs (per token or one number)
    padded = best_ms(lambda: collate(exps, 0, cpu, need_advantages=False), args.repeat)
    packed = best_ms(
        lambda: collate(exps, 0, cpu, need_advantages=False, share_prefix=True, pack=True), args.repeat
    )
    print(
        "| tree | payload (bytes/token) | pickle round trip (ms) | collate padded (ms) | packed, shared prefix (ms) |\n"
        f"|---|---:|---:|---:|---:|\n| {molt.__file__.rsplit('/molt/', 1)[0]} | {size / (n * args.samples):.1f} "
        f"| {round_trip:.1f} | {padded:.0f} | {packed:.0f} |"
    )


if __name__ == "__main__":
    main()
