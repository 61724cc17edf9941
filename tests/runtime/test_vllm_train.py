"""`molt train --rollout.engine vllm` end to end on vLLM's CPU build (`make vllm`): Ray workers holding a real
VLLMEngine, the FSDP trainer, and the refit vLLM takes by default (train.weight_sync auto: the collective group,
gloo on a CPU). Slow (vLLM's start-up takes minutes here): `.venv-vllm/bin/pytest -m 'vllm and slow'
tests/runtime/test_vllm_train.py`."""

import asyncio
import importlib.util

import pytest
from test_train_e2e import _assert_logprobs_match_versions, _cfg, _read

from molt.runtime.loop import run_training

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (`make vllm`)"
    ),
]


def test_train_on_vllm_with_collective_refit(tmp_path, ray_local, monkeypatch):
    """Three synchronous steps: every step's tokens come from the weights of the step before (the refit reached
    vLLM: each token's behavior log-prob is the trainer's export of its version), and the run trains."""
    from molt.testing.models import build_tiny_llama

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: plenty for a tiny model
    model = build_tiny_llama(tmp_path / "tiny", hidden_size=256)  # head_dim 64: vLLM's CPU attention takes it
    out = tmp_path / "run"
    cfg = _cfg(
        model, out, rollout__engine="vllm", train__max_staleness=0, ckpt__save_steps=1, ckpt__save_hf=True
    )
    cfg.vllm.engine_args = {"enforce_eager": "true"}  # no compile: starts faster
    summary = asyncio.run(run_training(cfg))
    assert summary["steps"] == 3
    assert _assert_logprobs_match_versions(model, out) == {0, 1, 2}
    metrics = _read(out, "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(m["rollout/staleness_max"] == 0 for m in metrics)


def test_an_adapter_per_role_on_vllm(tmp_path, ray_local, monkeypatch):
    """Two roles, an adapter each (multiagent.adapters), served by vLLM as LoRAs: every dumped segment's behavior
    log-probs are the trainer's with its role's adapter, after the first refit too."""
    from pathlib import Path

    import numpy as np

    from molt.cli import load_config
    from molt.testing.models import build_tiny_llama
    from molt.testing.runs import jsonl

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    model = build_tiny_llama(tmp_path / "tiny", hidden_size=256)
    out, here = tmp_path / "run", Path(__file__).parent
    cfg = load_config(
        [
            *("--actor.model_name_or_path", str(model), "--ckpt.output_dir", str(out)),
            *("--train.agent_path", str(here / "agents" / "two_roles.py"), "--rollout.engine", "vllm"),
            *("--data.prompt_dataset", str(here.parents[1] / "recipes/math/data/single_train.jsonl")),
            *("--multiagent.roles", "planner,coder", "--multiagent.adapters", "--actor.lora_rank", "4"),
            *("--actor.adam.lr", "3e-2", "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "2"),
            *("--train.max_steps", "2", "--train.max_staleness", "0", "--train.dump_trajectories_steps", "1"),
        ]
    )
    cfg.vllm.engine_args = {"enforce_eager": "true"}  # no compile: starts faster
    asyncio.run(run_training(cfg))
    for step in (1, 2):
        for d in jsonl(out / "dumps" / f"step_{step}.jsonl"):
            mask = np.asarray(d["action_mask"], bool)
            gap = np.abs(np.asarray(d["trainer_logprobs"]) - np.asarray(d["behavior_logprobs"]))[mask]
            assert gap.max() < 1e-3, (step, d["role"])
    assert {d["role"] for d in jsonl(out / "dumps" / "step_2.jsonl")} == {"planner", "coder"}
