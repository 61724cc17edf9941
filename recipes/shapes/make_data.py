"""Write the shapes recipe's prompts (images inline as data URLs) and, with --model DIR, the tiny LLaVA it runs on.

python recipes/shapes/make_data.py --model runs/shapes/tiny-vlm
"""

import argparse
import json
import random
from pathlib import Path

from shapes_task import COLOURS, SHAPE_QUESTION, SHAPES, data_url, draw

HERE = Path(__file__).parent


def rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        shape, colour = rng.choice(SHAPES), rng.choice(sorted(COLOURS))
        out.append({"prompt": SHAPE_QUESTION, "images": [data_url(draw(shape, colour))], "label": shape})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="also build the tiny random vision-language checkpoint here")
    args = parser.parse_args()
    for name, n, seed in (("train", 64, 0), ("test", 16, 1)):
        path = HERE / "data" / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows(n, seed)))
        print(f"wrote {path} ({n} rows)")
    if args.model:
        from molt.testing.models import build_tiny_vlm

        print(f"built {build_tiny_vlm(args.model)}")


if __name__ == "__main__":
    main()
