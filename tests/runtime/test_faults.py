"""Runs that survive their parts failing (docs/reliability.md), each fault on a tiny real model: what was counted,
what was lost, the exit codes, and that a rerun of the same command resumes with an exactly-once ledger."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from molt.config import load_config
from molt.runtime.loop import Run, run_training
from molt.runtime.pool import RolloutTask, RunStopped
from molt.types import RolloutStatus, SamplingParams

ROOT = Path(__file__).parents[2]
AGENT = ROOT / "tests/runtime/agents/letters_env.py"
ROW = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "label": "5"}


def args(model_dir, out, steps=6, *extra):
    return ["--actor.model_name_or_path", str(model_dir), "--train.agent_path", str(AGENT), "--data.prompt_dataset",
            str(ROOT / "recipes/math/data/single_train.jsonl"), "--rollout.batch_size", "2",
            "--rollout.n_samples_per_prompt", "2", "--rollout.max_new_tokens", "8", "--train.max_steps", str(steps),
            "--train.max_staleness", "0", "--ckpt.output_dir", str(out), "--ray.num_cpus", "4", *extra]


def engine_pids(root: int) -> list[int]:
    """The embedded engines' processes (multiprocessing spawn children) among `root`'s descendants only: other
    people's processes on this machine are never touched."""
    found = []
    for p in psutil.Process(root).children(recursive=True):
        try:
            if "spawn_main" in " ".join(p.cmdline()):
                found.append(p.pid)
        except psutil.Error:
            pass
    return found


def ledger(out) -> list[dict]:
    path = Path(out) / "ledger.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def check_exactly_once(out, steps, groups_per_step=2):
    rows = ledger(out)
    keys = [tuple(r["key"]) for r in rows]
    assert len(keys) == steps * groups_per_step and len(set(keys)) == len(keys)  # none twice, none missing
    assert sorted(r["step"] for r in rows) == sorted(list(range(1, steps + 1)) * groups_per_step)
    metric_steps = [json.loads(line)["step"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    assert sorted(s for s in metric_steps if s > 0) == list(range(1, steps + 1))
    rollouts = [rid for r in rows for rid in r["rollouts"]]
    assert len(rollouts) == len(set(rollouts))  # no rollout trained twice


def when(predicate, then, *, poll=0.2):
    """Run `then()` on a thread as soon as `predicate()` holds (an event, not a deadline)."""
    stop = threading.Event()

    def watch():
        while not stop.wait(poll):
            if predicate():
                then()
                return
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return stop


# ------------------------------------------------------------------------------------------- engine crash
async def test_worker_restarts_a_dead_engine_with_its_weights_and_version(tiny_llama_dir, ray_local):
    import torch

    from molt.runtime.worker import RolloutWorker

    worker = RolloutWorker(str(tiny_llama_dir), str(AGENT), max_restarts=1)
    await worker.start()
    try:
        name = "model.layers.0.mlp.up_proj.weight"
        shape = tuple(_shape(tiny_llama_dir, name))
        await worker.begin_refit(False)
        await worker.update_weights([[(name, torch.full(shape, 0.25))]], 3)  # version 3, a weight changed
        await worker.end_refit()
        sums = await worker.weight_sums()
        params = SamplingParams(max_tokens=200, min_tokens=200)
        task = RolloutTask(ROW, (0, 0), "g", "g-s0-a0", 0, 3, seed=1)
        running = asyncio.create_task(worker.run(task, params))
        while worker.engine.engine.num_requests == 0:  # the rollout is generating: kill its engine
            assert not running.done(), running.result()
            await asyncio.sleep(0.01)
        first = worker.engine.engine
        os.kill(first._proc.pid, signal.SIGKILL)
        outcome = await running
        assert outcome.status is RolloutStatus.ENGINE_RESTART and worker.restarts == 1, outcome.error
        assert "the engine process exited (exit code -9)" in outcome.error
        assert worker.engine.engine is not first and first.exitcode == -signal.SIGKILL
        assert await worker.version() == 3 and await worker.weight_sums() == sums  # the weights it had
        again = await worker.run(RolloutTask(ROW, (0, 0), "g", "g-s0-a1", 0, 3, seed=1), SamplingParams(max_tokens=4))
        assert again.ok and {v for e in again.experiences for v in e.reload().versions if v >= 0} == {3}
        # a second death within the window is one more than max_restarts=1: the worker gives up
        os.kill(worker.engine.engine._proc.pid, signal.SIGKILL)
        while worker.engine.engine.exitcode is None:  # the worker learns of it from the engine's pipe
            await asyncio.sleep(0.01)
        with pytest.raises(RunStopped, match=r"died \(exit code -9\), 2 time\(s\)"):
            await worker.run(RolloutTask(ROW, (0, 1), "h", "h-s0-a0", 0, 3), SamplingParams(max_tokens=4))
    finally:
        await worker.stop()


def _shape(model_dir, name):
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        return f.get_slice(name).get_shape()


KILLER = """
import psutil
from molt.agents import Env, Result, StepEnvRunner

KILL_AT = {kill_at}  # the env steps (counted in this worker process) that SIGKILL the worker's engine process first


class KillerEnv(Env):
    calls = 0

    def __init__(self):
        self.turn = 0

    async def step(self, state):
        KillerEnv.calls += 1
        if KillerEnv.calls in KILL_AT:
            for p in psutil.Process().children():  # the engine (not reaped here: its parent's reader does)
                if p.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(p.cmdline()):
                    p.kill()
        self.turn += 1
        return Result(reward=state["action_text"].count("e") / 8, observation="Again.", terminated=self.turn == 2)


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(KillerEnv)
"""


def killer_args(model_dir, tmp_path, kill_at, steps, *extra):
    agent = tmp_path / "killer_env.py"
    agent.write_text(KILLER.format(kill_at=set(kill_at)))
    return args(model_dir, tmp_path / "run", steps, "--train.agent_path", str(agent), *extra)


def test_engine_killed_mid_rollout_is_restarted_and_the_run_goes_on(tiny_llama_dir, tmp_path, ray_local):
    # step 3's first env step (4 rollouts of 2 turns a step) kills the engine: that rollout's next model call
    # fails, and so does whatever else was in flight on the engine
    out = tmp_path / "run"
    summary = asyncio.run(run_training(load_config(killer_args(tiny_llama_dir, tmp_path, [17], 5,
                                                               "--rollout.max_failed_retries", "4"))))
    assert summary["steps"] == 5
    check_exactly_once(out, 5)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "rollout/failed/engine_restart" not in metrics[1]  # step 2: nothing had failed yet
    counted = metrics[-1]["rollout/failed/engine_restart"]  # the pool's counters are cumulative
    assert 1 <= counted <= 4 and not any(k.startswith(("rollout/failed/agent", "rollout/dropped")) for k in metrics[-1])
    retried = [rid for r in ledger(out) for rid in r["rollouts"] if not rid.endswith("-a0")]
    assert len(retried) == counted and all(r["step"] >= 3 for r in ledger(out) if set(r["rollouts"]) & set(retried))
    assert (out / "checkpoints" / "step_5" / "state.json").is_file()  # the final checkpoint


def test_an_engine_crash_loop_stops_the_run_with_a_checkpoint(tiny_llama_dir, tmp_path, ray_local):
    out = tmp_path / "run"
    # from step 2 on every env step kills the engine: no rollout of step 2 can finish
    cfg = load_config(killer_args(tiny_llama_dir, tmp_path, range(9, 999), 6, "--rollout.engine_max_restarts", "1"))
    with pytest.raises(RunStopped, match=r"died \(exit code -9\), 2 time\(s\) within 600 s.*step 1 is checkpointed"):
        asyncio.run(run_training(cfg))
    # 8 env steps a step: step 2's wait for rollouts is abandoned, step 1 is the checkpoint
    assert len(ledger(out)) == 2 and [p.name for p in (out / "checkpoints").iterdir()] == ["step_1"]


# ------------------------------------------------------------------------------------------- the trainer
def test_a_failing_trainer_rank_is_named_at_once(ray_local):
    """Rank 1 raises while rank 0 waits (as in a collective) for it: the call fails at once, naming rank 1."""
    from molt.runtime.trainer_group import TrainerGroup

    @ray_local.remote
    class Rank:
        def __init__(self, rank):
            self.rank = rank

        async def train_step(self):
            if self.rank == 1:
                raise ValueError("loss is nan")
            await asyncio.sleep(3600)

    group = object.__new__(TrainerGroup)
    group.ranks = [Rank.remote(0), Rank.remote(1)]
    with pytest.raises(RuntimeError, match="trainer rank 1 failed in train_step: ValueError: loss is nan"):
        asyncio.run(group.same("train_step"))
    for r in group.ranks:
        ray_local.kill(r)


def test_a_dead_trainer_rank_stops_the_run_and_a_rerun_resumes_exactly_once(tiny_llama_dir, tmp_path, ray_local):
    out = tmp_path / "run"
    cfg = load_config(args(tiny_llama_dir, out, 5, "--ckpt.save_steps", "2"))

    async def first():
        run = Run(cfg)
        try:
            await run.setup()
            when(lambda: len(ledger(out)) >= 6, lambda: ray_local.kill(run.trainer.ranks[0]))  # during step 4
            await run.train()
        finally:
            await run.close()
    with pytest.raises(RuntimeError, match="trainer rank 0 failed in"):
        asyncio.run(first())
    assert 3 <= len(ledger(out)) // 2 <= 4
    summary = asyncio.run(run_training(load_config(args(tiny_llama_dir, out, 5, "--ckpt.save_steps", "2"))))
    assert summary["steps"] == 5
    check_exactly_once(out, 5)


# ------------------------------------------------------------------------------------------- signals, run directory
def test_sigint_checkpoints_exits_130_and_the_same_command_resumes(tiny_llama_dir, tmp_path, ray_local):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "molt.cli", "train", *args(tiny_llama_dir, out)],
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    when(lambda: len(ledger(out)) >= 4, lambda: os.killpg(proc.pid, signal.SIGINT))  # Ctrl-C: the whole group
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode == 130, err
    assert "stopped by SIGINT; step" in err
    stopped = len(ledger(out)) // 2
    assert 2 <= stopped < 6 and (out / "checkpoints" / f"step_{stopped}" / "state.json").is_file()
    summary = asyncio.run(run_training(load_config(args(tiny_llama_dir, out))))
    assert summary["steps"] == 6
    check_exactly_once(out, 6)


def test_a_second_signal_exits_at_once(tiny_llama_dir, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "molt.cli", "train", *args(tiny_llama_dir, out, 400)],
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    when(lambda: len(ledger(out)) >= 2, lambda: proc.send_signal(signal.SIGTERM))
    for line in proc.stderr:  # the first signal is acknowledged; the second one ends the process
        if "stopping after the step in progress" in line:
            proc.send_signal(signal.SIGINT)
            break
    proc.wait(timeout=120)
    os.killpg(proc.pid, signal.SIGKILL) if psutil.pid_exists(proc.pid) else None
    assert proc.returncode == 128 + signal.SIGINT


def test_a_run_directory_holds_one_run(tiny_llama_dir, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "ledger.jsonl").write_text('{"step": 1, "key": [0, 3], "group_id": "e0-p3", "rollouts": []}\n')
    with pytest.raises(ValueError, match="holds another run .* no complete checkpoint"):
        asyncio.run(Run(load_config(args(tiny_llama_dir, out))).setup())
    (out / "checkpoints" / "step_1").mkdir(parents=True)
    (out / "checkpoints" / "step_1" / "state.json").write_text("{}")
    with pytest.raises(ValueError, match="ckpt.resume is off"):
        asyncio.run(Run(load_config(args(tiny_llama_dir, out, 6, "--ckpt.no-resume"))).setup())
