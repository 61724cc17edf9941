"""A run killed mid-way (SIGKILL of the whole process group) resumes from its checkpoint; its ledger then shows
every trained prompt group exactly once and its metrics every step exactly once."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from molt.cli import load_config
from molt.runtime.loop import run_training

ROOT = Path(__file__).parents[2]
LORA = pytest.mark.parametrize("lora", [[], ["--actor.lora_rank", "4"]], ids=["full", "lora"])


def _args(model_dir, out, extra=()):
    return [
        *extra,
        "--actor.model_name_or_path",
        str(model_dir),
        "--train.agent_path",
        str(ROOT / "tests/runtime/agents/letters_env.py"),
        "--data.prompt_dataset",
        str(ROOT / "recipes/math/data/single_train.jsonl"),
        "--rollout.batch_size",
        "2",
        "--rollout.n_samples_per_prompt",
        "2",
        "--rollout.max_new_tokens",
        "8",
        "--train.max_steps",
        "6",
        "--train.max_staleness",
        "0",
        "--ckpt.save_steps",
        "1",
        "--ckpt.output_dir",
        str(out),
        "--ray.num_cpus",
        "4",
        "--rollout.no_engine_process",
    ]  # in the worker: 5 s less start-up a run


@pytest.mark.slow  # 50 s; the default suite resumes after SIGINT and after a dead trainer rank (test_faults.py),
# and the chaos runs kill the whole run as this test does
@LORA
def test_killed_run_resumes_with_an_exactly_once_ledger(tiny_llama_dir, tmp_path, ray_local, lora):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "molt.cli", "train", *_args(tiny_llama_dir, out, lora)],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 240
    while not (out / "checkpoints" / "step_2" / "state.json").is_file():
        assert proc.poll() is None and time.time() < deadline, "the first run should reach step 2"
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver, its Ray instance, workers and trainer ranks
    proc.wait()
    killed_at = len((out / "ledger.jsonl").read_text().splitlines()) // 2
    assert 2 <= killed_at < 6

    summary = asyncio.run(run_training(load_config(_args(tiny_llama_dir, out, lora))))
    assert summary["steps"] == 6
    ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    keys = [tuple(r["key"]) for r in ledger]
    assert len(keys) == 12 and len(set(keys)) == 12  # 6 steps x 2 groups, none twice
    assert sorted(r["step"] for r in ledger) == sorted(list(range(1, 7)) * 2)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sorted(s for s in steps if s > 0) == list(range(1, 7))
    # nothing skipped: synchronous dispatch takes prompts in the seeded order, so the trained keys are exactly
    # the first 12 of it, although the groups in flight at the kill were lost with the process
    from molt.runtime.pool import PromptStream

    rows = [None] * 80
    expected = [k for (k, _), _ in zip(PromptStream(rows, seed=42), range(12))]
    assert set(keys) == set(expected)


def _rank_state(rank):
    """What a trainer rank's checkpoint must bring back: its shares of the weights and of Adam's moments (sums of
    the local shards), Adam's step counts, the optimizer-step counter and the LR schedule's position."""
    import torch

    def local(t):
        return (t.to_local() if hasattr(t, "to_local") else t).double()

    a = rank.actor
    state = list(a.optimizers[0].state.values())  # AdamW (the only optimizer without muon)
    return {
        "weights": sum(float(local(p).sum()) for p in a.model.parameters()),
        "exp_avg": sum(float(local(s["exp_avg"]).abs().sum()) for s in state),
        "exp_avg_sq": sum(float(local(s["exp_avg_sq"]).sum()) for s in state),
        "adam_steps": {float(torch.as_tensor(s["step"])) for s in state},
        "step": a.step,
        "schedule": a.schedulers[0].last_epoch,
        "lr": a.schedulers[0].get_last_lr()[0],
    }


async def _states(run) -> list[dict]:
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this test file
    return [await r.__ray_call__.remote(_rank_state) for r in run.trainer.ranks]


def _merged(states: list[dict]) -> dict:
    """One dict for the data-parallel ranks: shard sums add up, counters are equal on every rank."""
    for key in ("adam_steps", "step", "schedule", "lr"):
        assert all(s[key] == states[0][key] for s in states), key
    return {**states[0], **{k: sum(s[k] for s in states) for k in ("weights", "exp_avg", "exp_avg_sq")}}


@LORA
def test_resume_restores_trainer_state_and_pool_counters_at_another_world_size(
    tiny_llama_dir, tmp_path, ray_local, lora
):
    """Saved by one trainer rank at step 2, resumed by two: the weights, Adam's moments and step counts, the
    schedule, the controller's step/version/ledger/token count, the engines' weights and the pool's counters
    are the saved ones (a fresh trainer would have no moments and step 0; a fresh pool no failures). With LoRA
    the weights are the adapters' and the engines get only the merged targeted modules on top of the base."""
    from molt.runtime.loop import Run

    out = tmp_path / "run"
    args = _args(tiny_llama_dir, out, lora)
    args += ["--actor.lr_scheduler", "cosine", "--actor.lr_warmup_steps", "1", "--actor.adam.lr", "1e-3"]

    async def first():
        run = Run(load_config([*args, "--train.max_steps", "2", "--ckpt.save_steps", "2"]))
        try:
            await run.setup()
            await run.train()
            return _merged(await _states(run)), await run.workers.actors[0].weight_sums.remote(), run
        finally:
            await run.close()

    saved, engine, done = asyncio.run(first())
    assert saved["step"] == 2 and saved["adam_steps"] == {2.0} and saved["exp_avg_sq"] > 0
    state_file = out / "checkpoints" / "step_2" / "state.json"
    state = json.loads(state_file.read_text())
    # the prompt stream's state, not the ledger: bounded by the groups in flight, whatever the run's length
    assert "ledger" not in state and state["stream"]["next"] >= 4 and len(state["stream"]["done"]) <= 4
    state["counters"] = {**state["counters"], "failed/timeout": 7}  # as if two rollouts had timed out
    state_file.write_text(json.dumps(state))

    async def second():
        run = Run(load_config([*args, "--train.max_steps", "3", "--train.num_ranks", "2"]))
        try:
            await run.setup()
            await run._load_checkpoint()
            restored, sums = _merged(await _states(run)), await run.workers.actors[0].weight_sums.remote()
            controller = (
                run.step,
                run.stream,
                run.generated_tokens,
                await run.workers.actors[0].version.remote(),
            )
            run._resume_from = None  # loaded above
            await run.train()
            return restored, sums, controller
        finally:
            await run.close()

    restored, sums, controller = asyncio.run(second())
    for key in ("weights", "exp_avg", "exp_avg_sq"):
        assert restored[key] == pytest.approx(saved[key], rel=1e-6), key
    assert {k: restored[k] for k in ("adam_steps", "step", "schedule", "lr")} == {
        k: saved[k] for k in ("adam_steps", "step", "schedule", "lr")
    }
    assert controller == (2, state["stream"], done.generated_tokens, 2)
    assert sums == pytest.approx(engine, rel=1e-6)  # the engines were refit with the checkpoint's weights
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert metrics[-1]["rollout/failed/timeout"] == 7  # the pool counts on from the checkpoint
