"""Write the calculator chains as JSONL: `python make_data.py OUT_DIR [--steps 3] [--seed 0]`.

A chain starts with a single-digit sum and then adds or subtracts single digits, staying at or above zero (the
135M base model is weak even at single-digit sums; the calculator is there to help). 200 chains to train, 30
held out, all distinct. Rows: {"prompt": [{"role": "user", "content": "What is 3 + 4?"}], "label": "[3, 4, -2, 6]"}:
the label is the chain's signed numbers as JSON text; the agent asks the later steps itself.
"""
import argparse
import json
import random
from pathlib import Path

from calculator_task import questions


def chain(rng: random.Random, steps: int) -> list[int]:
    numbers = [rng.randint(0, 9), rng.randint(0, 9)]
    total = sum(numbers)
    for _ in range(steps - 1):
        n = rng.randint(1, 9)
        if n <= total and rng.random() < 0.5:  # subtract only while the result stays >= 0
            n = -n
        numbers.append(n)
        total += n
    return numbers


def rows(n_train: int = 200, n_test: int = 30, steps: int = 3, seed: int = 0) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    chains: dict[tuple[int, ...], None] = {}  # insertion-ordered set: distinct chains, reproducible order
    while len(chains) < n_train + n_test:
        chains[tuple(chain(rng, steps))] = None
    # the first question comes from the agent's own helper, so the data and the agent cannot disagree
    out = [{"prompt": [{"role": "user", "content": questions(list(c))[0]}], "label": json.dumps(list(c))}
           for c in chains]
    return out[:n_train], out[n_train:]


def write(out_dir: str | Path, steps: int = 3, seed: int = 0) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.jsonl", out / "test.jsonl"
    for path, split in zip(paths, rows(steps=steps, seed=seed)):
        path.write_text("".join(json.dumps(r) + "\n" for r in split))
    return paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(*write(args.out_dir, args.steps, args.seed))
