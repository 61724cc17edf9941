"""Write the products as JSONL: `python make_data.py OUT_DIR [--seed 0]`.

Each row asks for the product of two two-digit numbers (12 to 99), beyond a 135M model's mental arithmetic and
easy with the tool: {"prompt": [{"role": "user", "content": "What is 61 * 65?"}], "label": 3965}. 200 to train,
30 held out, all distinct, none the worked example's (agent.EXAMPLE).
"""

import argparse
import json
import random
from pathlib import Path

EXAMPLE = (23, 41)  # agent.EXAMPLE (not imported: the agent imports the SDK)


def rows(n_train: int = 200, n_test: int = 30, seed: int = 0) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    pairs: dict[tuple[int, int], None] = {}  # insertion-ordered: distinct pairs, reproducible order
    while len(pairs) < n_train + n_test:
        pair = rng.randint(12, 99), rng.randint(12, 99)
        if pair != EXAMPLE:
            pairs.setdefault(pair)
    out = [{"prompt": [{"role": "user", "content": f"What is {a} * {b}?"}], "label": a * b} for a, b in pairs]
    return out[:n_train], out[n_train:]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, split in zip(("train.jsonl", "test.jsonl"), rows(seed=args.seed)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in split))
        print(out / name)
