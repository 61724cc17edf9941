"""`molt train --env.id` end to end on the real tiny model: Ray workers play hub environments (no agent file,
no dataset), metrics and evaluation are per environment, and a resumed run goes on with the same mixture."""

import asyncio
import json

import pytest

from molt.cli import load_config
from molt.config_resolve import override
from molt.runtime.data import run_prompts
from molt.runtime.loop import run_training
from molt.testing.runs import jsonl

pytest.importorskip("reasoning_gym", reason="the envs extra (`make envs`) is not installed")
pytest.importorskip("gem", reason="the envs extra (`make envs`) is not installed")

MIX = "reasoning_gym:chain_sum,gem:game:GuessTheNumber-v0-easy"
ARGS = '[{"min_terms": 2, "max_terms": 2, "max_digits": 1}, {}]'


def _argv(model, out, *more):
    return [
        *("--actor.model_name_or_path", str(model), "--ckpt.output_dir", str(out)),
        *("--env.id", MIX, "--env.args", ARGS, "--env.probs", "0.5,0.5"),
        *("--env.train_size", "16", "--env.eval_size", "2", "--eval.n_samples_per_prompt", "2"),
        *(
            "--rollout.batch_size",
            "2",
            "--rollout.n_samples_per_prompt",
            "2",
            "--rollout.max_new_tokens",
            "8",
        ),
        *("--rollout.max_turns", "3", "--rollout.no_engine_process", "--train.max_steps", "2"),
        *more,
    ]


def test_a_mixture_of_two_hubs_trains_evaluates_and_resumes(tiny_llama_dir, tmp_path, ray_local):
    out = tmp_path / "run"
    cfg = load_config(_argv(tiny_llama_dir, out, "--ckpt.save_steps", "1"))
    rows, evals = run_prompts(cfg)
    assert rows == run_prompts(cfg)[0]  # a pure function of the configuration: resume replays the mixture
    assert {r["env"] for r in rows} == set(MIX.split(",")) and len(evals) == 4
    summary = asyncio.run(run_training(cfg))
    assert summary["steps"] == 2
    metrics = jsonl(out / "metrics.jsonl")
    assert all(f"eval/env/{env}/accuracy" in metrics[-1] for env in MIX.split(","))
    trained = {key for m in metrics for key in m if key.startswith("rollout/env/")}
    assert trained and trained <= {f"rollout/env/{env}/reward_mean" for env in MIX.split(",")}
    ledger = jsonl(out / "ledger.jsonl")
    for group in {r["group_id"] for r in ledger}:  # a group is one task of one environment
        assert (
            len({json.dumps(rows[tuple(r["key"])[1]]["label"]) for r in ledger if r["group_id"] == group})
            == 1
        )

    asyncio.run(run_training(override(cfg, {"train.max_steps": 3})))
    again = jsonl(out / "ledger.jsonl")
    keys = [tuple(r["key"]) for r in again]
    assert len(keys) == len(set(keys)) and max(r["step"] for r in again) == 3  # each task trained once
