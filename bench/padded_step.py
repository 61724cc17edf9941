"""Benchmark: one padded `Actor.train_step` of normal size (a 4,096-token budget, rows of mixed length), CPU fp32.

Made for the change that stopped giving padded rows an attention mask (`molt.trainer.batching`): run it with
`PYTHONPATH` pointing at each tree to compare (the molt it imports is the one measured):

    PYTHONPATH=TREE .venv/bin/python bench/padded_step.py [--rows 32] [--steps 5] [--dir /tmp/padded-step-model]

Model: a randomly initialised Llama (hidden 256, 4 layers, 4 heads, 2 KV heads, vocabulary 4,096; built once
into `--dir`). Window: `--rows` sequences of 128-1,024 tokens (seeded), a quarter prompt, the rest actions,
planned into padded micro-batches of at most `--budget` padded tokens (`train.max_tokens_per_gpu`); prefix
sharing off (rows share no prompt anyway). After a warm-up step, `--steps` steps; reported: the median step's
process CPU seconds (the number to compare on a shared machine) and wall seconds.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path


def build(path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from molt.testing.models import build_tokenizer

    tokenizer = build_tokenizer(vocab_size=4096)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=4096,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def window(rows: int, vocab: int) -> list:
    from windows import experience  # beside this file

    rng, out = random.Random(0), []
    for i in range(rows):
        n = rng.randint(128, 1024)
        ids = [rng.randrange(10, vocab) for _ in range(n)]
        out.append(experience(f"r{i}", f"g{i}", ids[: n // 4], ids[n // 4 :], rng.gauss(0.0, 1.0)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/padded-step-model"))
    args = parser.parse_args()
    if not (args.dir / "config.json").exists():
        build(args.dir)
    from molt.trainer import Actor

    actor = Actor.from_pretrained(
        str(args.dir),
        **{
            "fsdp.device": "cpu",
            "train.max_tokens_per_gpu": args.budget,
            "train.share_prefix": False,
            "actor.adam.lr": 1e-6,
        },
    )
    exps = window(args.rows, actor.model.lm.config.vocab_size)
    actor.train_step(exps)  # warm-up
    cpu, wall = [], []
    for _ in range(args.steps):
        c0, w0 = time.process_time(), time.perf_counter()
        actor.train_step(exps)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    print(
        json.dumps(
            {
                "tokens": sum(e.num_tokens for e in exps),
                "cpu_s": statistics.median(cpu),
                "wall_s": statistics.median(wall),
                "cpu_all": [round(c, 3) for c in cpu],
            }
        )
    )


if __name__ == "__main__":
    main()
