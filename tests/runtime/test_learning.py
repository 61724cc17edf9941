"""Learning on the tiny model: GRPO with a reward for one token ('Q', the only token of the tiny vocabulary
holding that letter) raises the policy's probability of that token within a few steps. The probability is
measured independently of the run: a plain forward of the base checkpoint and of the exported policy at the
first reply position of the held-out math prompts."""

import asyncio
import json
from pathlib import Path

import pytest
import torch

from molt.config import MoltConfig
from molt.config_validate import validate
from molt.runtime.loop import run_training

AGENTS = Path(__file__).parent / "agents"
DATA = Path(__file__).parents[2] / "recipes" / "math" / "data"


def _p_token(model_dir, tokenizer, text: str) -> float:
    """Mean probability of the one token `text` at the first reply position of the 20 held-out prompts."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert [tokenizer.decode([t]) for t in range(lm.config.vocab_size)].count(text) == 1
    (token,) = tokenizer.encode(text, add_special_tokens=False)
    rows = [json.loads(line) for line in (DATA / "single_test.jsonl").read_text().splitlines()]
    total = 0.0
    for row in rows:
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        with torch.no_grad():
            logits = lm(torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])).logits[0, -1]
        total += float(torch.softmax(logits, -1)[token])
    return total / len(rows)


@pytest.mark.parametrize("seed", [1])  # seeds 1, 2, 3 measured 10x, 15x, 8x (docs/testing.md)
def test_a_reward_for_one_token_is_learned(tiny_llama_dir, tokenizer, tmp_path, ray_local, seed):
    cfg = MoltConfig()
    cfg.actor.model_name_or_path = str(tiny_llama_dir)
    cfg.actor.adam.lr = 1e-2
    cfg.train.agent_path = str(AGENTS / "token_env.py")
    cfg.data.prompt_dataset = str(DATA / "single_train.jsonl")
    cfg.train.max_steps, cfg.train.max_staleness, cfg.train.seed = 5, 0, seed
    cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt, cfg.rollout.max_new_tokens = 4, 16, 16
    cfg.ckpt.output_dir = str(tmp_path / "run")
    cfg.rollout.engine_process = False  # in the worker: 5 s less start-up (tests/runtime/test_train_e2e.py)
    asyncio.run(run_training(validate(cfg)))
    before, after = (
        _p_token(tiny_llama_dir, tokenizer, "Q"),
        _p_token(tmp_path / "run" / "policy", tokenizer, "Q"),
    )
    print(f"seed {seed}: p('Q') {before:.4f} -> {after:.4f}")
    assert after > 3 * before, (before, after)
