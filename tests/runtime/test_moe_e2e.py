"""`molt train` on the tiny Qwen2-MoE with routing replay (R3): the engine's routes travel through capture and
the object store to the trainer, which replays them and reports route agreement and log-prob gaps per step."""

import asyncio
import json
import math
from pathlib import Path

from molt.cli import load_config
from molt.runtime.loop import run_training

HERE = Path(__file__).parent
DATA = HERE.parents[1] / "recipes" / "math" / "data"


def _train(model_dir, out, *flags):
    argv = [
        "--actor.model_name_or_path",
        str(model_dir),
        "--actor.adam.lr",
        "1e-3",
        "--train.agent_path",
        str(HERE / "agents" / "letters_env.py"),
        "--data.prompt_dataset",
        str(DATA / "single_train.jsonl"),
        "--train.max_steps",
        "3",
        "--rollout.batch_size",
        "2",
        "--rollout.n_samples_per_prompt",
        "4",
        "--rollout.max_new_tokens",
        "12",
        "--rollout.timeout_s",
        "30",
        "--ckpt.output_dir",
        str(out),
        "--train.routing_replay",
        "--actor.aux_loss_coef",
        "0.001",
        *flags,
    ]
    asyncio.run(run_training(load_config(argv)))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_sync_replay_reproduces_the_engine(tiny_moe_dir, tmp_path, ray_local):
    # the engine in the worker (5 s less start-up); the run below sends the routes through the engine's pipe
    metrics = _train(
        tiny_moe_dir, tmp_path / "run", "--train.max_staleness", "0", "--rollout.no_engine_process"
    )
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:  # on-policy, fp32: replayed log-probs are the engine's; the free forward may differ
        assert m["is/logprob_gap"] < 1e-4
        assert 0.0 <= m["moe/route_agreement"] <= 1.0 and m["moe/logprob_gap"] >= 0.0
        assert math.isfinite(m["moe/aux_loss"])


def test_async_partial_rollout_reports_routes_per_step(tiny_moe_dir, tmp_path, ray_local):
    metrics = _train(
        tiny_moe_dir,
        tmp_path / "run",
        "--train.max_staleness",
        "2",
        "--train.partial_rollout_enable",
        "--train.max_steps",
        "4",
    )
    assert len(metrics) == 4 and max(m["rollout/staleness_max"] for m in metrics) <= 2
    for m in metrics:
        for key in ("moe/route_agreement", "moe/logprob_gap", "is/logprob_gap"):
            assert math.isfinite(m[key]), key
    # tokens sampled by older policies: the trainer's own routing drifts from theirs
    assert min(m["moe/route_agreement"] for m in metrics) < 1.0
