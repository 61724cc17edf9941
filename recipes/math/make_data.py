"""Write the arithmetic task as JSONL prompt files: `python make_data.py OUT_DIR [--kind single|mixed]`.

- `single`: every single-digit sum a + b (100 problems), shuffled with a fixed seed: 80 to train, 20 held out
  (the workload of the TRL comparison in docs/benchmarks.md).
- `mixed`: one- and two-digit addition and subtraction, 400 to train, 50 held out.
Rows: {"prompt": [{"role": "user", "content": "What is a + b?"}], "label": "<answer>"}.
"""

import argparse
import json
import random
from pathlib import Path


def problems(kind: str, seed: int = 0) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    if kind == "single":
        pairs = [(a, "+", b) for a in range(10) for b in range(10)]
        n_train = 80
    elif kind == "mixed":
        pairs = list({(rng.randint(0, 99), rng.choice("+-"), rng.randint(0, 99)) for _ in range(600)})[:450]
        n_train = 400
    else:
        raise ValueError(f"kind must be single or mixed (got {kind!r})")
    rng.shuffle(pairs)
    rows = [
        {
            "prompt": [{"role": "user", "content": f"What is {a} {op} {b}?"}],
            "label": str(a + b if op == "+" else a - b),
        }
        for a, op, b in pairs
    ]
    return rows[:n_train], rows[n_train:]


def write(out_dir: str | Path, kind: str = "single", seed: int = 0) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, test = problems(kind, seed)
    paths = out / f"{kind}_train.jsonl", out / f"{kind}_test.jsonl"
    for path, rows in zip(paths, (train, test)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--kind", default="single", choices=["single", "mixed"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(*write(args.out_dir, args.kind, args.seed))
