"""Write a small generated chat set for `molt sft`: `python make_data.py OUT_DIR [--tools] [--n 240]`.

Each chat is two user turns about two-digit numbers and the assistant's answers in one fixed style:
"What is 17 + 25?" -> "17 + 25 = 42.", then "And twice that?" -> "2 * 42 = 84.". With `--tools` the first
answer goes through an `add` tool call and its result (an assistant turn with `tool_calls`, a `tool` turn),
for chat templates that render tool calls (SmolLM2's does not, so the recipe uses plain chats).
Rows: {"messages": [...OpenAI chat messages], "tools": [...] (with --tools)}; 1/6 of them held out.
"""

import argparse
import json
import random
from pathlib import Path

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
FOLLOW_UPS = [("And twice that?", "2 * {c} = {d}."), ("And that plus 10?", "{c} + 10 = {e}.")]


def chat(a: int, b: int, rng: random.Random, tools: bool) -> dict:
    c = a + b
    question, answer = rng.choice(FOLLOW_UPS)
    messages = [{"role": "user", "content": f"What is {a} + {b}?"}]
    if tools:
        call = {
            "id": "call_0",
            "type": "function",
            "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})},
        }
        messages += [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": str(c)},
        ]
    messages += [
        {"role": "assistant", "content": f"{a} + {b} = {c}."},
        {"role": "user", "content": question},
        {"role": "assistant", "content": answer.format(c=c, d=2 * c, e=c + 10)},
    ]
    return {"messages": messages, **({"tools": [ADD]} if tools else {})}


def write(out_dir: str | Path, n: int = 240, tools: bool = False, seed: int = 0) -> tuple[Path, Path]:
    rng = random.Random(seed)
    pairs = rng.sample([(a, b) for a in range(10, 100) for b in range(10, 100)], n)
    rows = [chat(a, b, rng, tools) for a, b in pairs]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    held = n // 6
    paths = out / "train.jsonl", out / "test.jsonl"
    for path, part in zip(paths, (rows[held:], rows[:held])):
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
    return paths


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", nargs="?", default=str(Path(__file__).parent / "data"))
    p.add_argument("--n", type=int, default=240, help="chats in all (default 240)")
    p.add_argument("--tools", action="store_true", help="answer the first question through an add tool call")
    args = p.parse_args()
    print(*write(args.out_dir, args.n, args.tools))
