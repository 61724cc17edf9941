"""The reference's quick-start launch flags, unchanged but for paths and sizes, train a tiny model for two steps
with agent files written the way the reference's examples are, on a parquet dataset with a `reward_model`
label column; the flags that cannot mean anything here say so, one line each."""

import asyncio
import json
from pathlib import Path

import pytest

from molt.cli import load_config
from molt.runtime.loop import run_training

ROOT = Path(__file__).parents[2]
AGENTS = {
    "math_env.py": ROOT / "tests/data/agents/math_env.py",  # grades observation_text + action_text
    "chat_agent.py": ROOT / "tests/agents/examples/chat_agent.py",
}  # AsyncOpenAI, ctx.model_name, ...
# sizes: the quick-start's are for Qwen3-4B on 8 GPUs; 2 prompts a step, 4 of them in all -> 2 steps
SIZES = {
    "--data.max_samples": "4",
    "--rollout.batch_size": "2",
    "--train.batch_size": "8",
    "--ckpt.save_steps": "1",
    "--rollout.n_samples_per_prompt": "8",
}


def _datasets(tmp_path):
    import datasets

    rows = [
        json.loads(line) for line in (ROOT / "recipes/math/data/single_train.jsonl").read_text().splitlines()
    ]
    verl = [
        {"prompt": r["prompt"], "reward_model": {"ground_truth": r["label"], "style": "rule"}} for r in rows
    ]
    datasets.Dataset.from_list(verl[:8]).to_parquet(tmp_path / "train.parquet")
    datasets.Dataset.from_list(verl[8:10]).to_json(tmp_path / "test.json")  # JSON lines, through `datasets`
    return tmp_path / "train.parquet", tmp_path / "test.json"


def _argv(quickstart_argv, model, agent, tmp_path, sizes):
    train, test = _datasets(tmp_path)
    argv = quickstart_argv(
        MODEL_PATH=model,
        PROMPT_DATASET=train,
        ACTOR_GPUS=1,
        VLLM_TP=1,
        AGENT_FILE=agent,
        EVAL_DATASET=test,
        SAVE_ROOT=tmp_path / "save",
    )
    return [sizes.get(argv[i - 1], a) if i else a for i, a in enumerate(argv)] + ["--ray.num_cpus", "4"]


# the second run adds what the quick-start leaves out: PPO epochs, an adaptive KL, HF exports with checkpoints
EXTRA = {
    "math_env.py": ({}, []),
    "chat_agent.py": ({"--train.max_epochs": "2"}, ["--algo.kl.target", "1e-3", "--ckpt.save_hf"]),
}


@pytest.mark.parametrize("agent", ["math_env.py", "chat_agent.py"])
def test_quickstart_flags_train_two_steps(
    tiny_llama_dir, tmp_path, ray_local, quickstart_argv, capsys, agent
):
    sizes, extra = EXTRA[agent]
    cfg = load_config(
        _argv(quickstart_argv, tiny_llama_dir, AGENTS[agent], tmp_path, {**SIZES, **sizes}) + extra
    )
    notes = capsys.readouterr().err
    for flag in (
        "--vllm.num_engines",
        "--vllm.gpu_memory_utilization",
        "--vllm.distributed_executor_backend",
    ):
        assert f"{flag}: no effect with the embedded engine (rollout.engine=hf)" in notes
    assert "--data.apply_chat_template: no effect: Molt always renders prompts" in notes
    summary = asyncio.run(run_training(cfg))
    assert summary["steps"] == 2  # train.num_episodes 1 over data.max_samples 4 prompts, 2 a step
    out = tmp_path / "save" / "hf"  # --ckpt.output_dir "$SAVE_ROOT/hf": the run directory
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if m["step"] > 0 and "policy_loss" in m]
    assert len(trained) == 2
    for m in trained:  # geo gate with the quick-start's band, KL k2 as a loss, clipped rewards in [0, 1]
        assert 0.0 <= m["is_filter_ratio"] <= 1.0 and "kl/mean" in m and 0 <= m["rollout/reward_mean"] <= 1
    assert any(k.startswith("eval_test_pass1") for k in metrics[0])  # eval.n_samples_per_prompt 1, at start
    assert [p.name for p in sorted((tmp_path / "save" / "state").glob("step_*"))] == ["step_1", "step_2"]
    ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    assert all(len(r["rollouts"]) == 8 for r in ledger)
    if extra:  # KL below its target: the coefficient shrinks from 0.001; each checkpoint holds a HF policy
        assert trained[0]["kl_coef"] < 0.001 and trained[1]["kl_coef"] < trained[0]["kl_coef"]
        assert (tmp_path / "save" / "state" / "step_2" / "hf" / "config.json").is_file()
