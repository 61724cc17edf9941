"""Write the calculator chains as JSONL: `python make_data.py OUT_DIR [--steps 3] [--seed 0]`.

A chain starts with a product of two two-digit numbers, then multiplies the result by a one-digit number and adds
a three-digit one, e.g. [23, "* 41", "* 7", "+ 386"]: beyond a 135M model's mental arithmetic, easy with the
calculator. 200 chains to train, 30 held out, all distinct. Rows: {"prompt": [{"role": "user", "content":
"What is 23 * 41?"}], "label": "[23, \"* 41\", \"* 7\", \"+ 386\"]"}: the label is the chain as JSON text; the
agent asks the later steps itself.
"""

import argparse
import json
import random
from pathlib import Path

from calculator_task import questions


def chain(rng: random.Random, steps: int) -> list:
    items: list = [rng.randint(12, 99), f"* {rng.randint(12, 99)}"]
    for k in range(steps - 1):  # later steps alternate: multiply by one digit, add three
        items.append(f"* {rng.randint(3, 9)}" if k % 2 == 0 else f"+ {rng.randint(100, 999)}")
    return items


def rows(
    n_train: int = 200, n_test: int = 30, steps: int = 3, seed: int = 0
) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    chains: dict[str, list] = {}  # insertion-ordered: distinct chains, reproducible order
    while len(chains) < n_train + n_test:
        c = chain(rng, steps)
        chains.setdefault(json.dumps(c), c)
    # the first question comes from the agent's own helper, so the data and the agent cannot disagree
    out = [
        {"prompt": [{"role": "user", "content": questions([str(c[0]), *c[1:]])[0]}], "label": label}
        for label, c in chains.items()
    ]
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
