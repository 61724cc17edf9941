"""Runs whose engine dies (docs/reliability.md), on a tiny real model: the worker revives it with its weights and
version, at any call of a refit, and a run goes on, or stops with a checkpoint and the root cause when it cannot."""

import asyncio
import os
import signal
from pathlib import Path

import psutil
import pytest
from fault_runs import AGENT, ROW, args, ledger

from molt.cli import load_config
from molt.runtime.loop import Run, run_training
from molt.runtime.pool import RolloutTask, RunStopped
from molt.testing.runs import check_exactly_once, descendants, gone, jsonl
from molt.types import RolloutStatus, SamplingParams


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
        task = RolloutTask(ROW, (0, 0), "g", "g-s0-a0", 0, seed=1)
        running = asyncio.create_task(rollout(worker, task, params))
        while worker.engine.engine.num_requests == 0:  # the rollout is generating: kill its engine
            assert not running.done(), running.result()
            await asyncio.sleep(0.01)
        first = worker.engine.engine
        os.kill(first._proc.pid, signal.SIGKILL)
        outcome, _ = await running
        assert outcome.status is RolloutStatus.ENGINE_RESTART and worker.restarts == 1, outcome.error
        assert "the engine process exited (exit code -9)" in outcome.error
        assert worker.engine.engine is not first and first.exitcode == -signal.SIGKILL
        assert await worker.version() == 3 and await worker.weight_sums() == sums  # the weights it had
        again, payloads = await rollout(
            worker, RolloutTask(ROW, (0, 0), "g", "g-s0-a1", 0, seed=1), SamplingParams(max_tokens=4)
        )
        assert again.ok and len(payloads) == len(again.experiences) >= 1
        assert {v for p in payloads for v in p["versions"] if v >= 0} == {3}
        # a second death within the window is one more than max_restarts=1: the worker gives up
        os.kill(worker.engine.engine._proc.pid, signal.SIGKILL)
        while worker.engine.engine.exitcode is None:  # the worker learns of it from the engine's pipe
            await asyncio.sleep(0.01)
        with pytest.raises(RunStopped, match=r"died \(killed by SIGKILL\), 2 time\(s\)"):
            await rollout(worker, RolloutTask(ROW, (0, 1), "h", "h-s0-a0", 0), SamplingParams(max_tokens=4))
    finally:
        await worker.stop()


async def test_an_engine_dead_at_any_call_of_a_refit_is_revived_with_the_refit(tiny_llama_dir, ray_local):
    import torch

    from molt.runtime.worker import RolloutWorker

    worker = RolloutWorker(str(tiny_llama_dir), str(AGENT), max_restarts=4)
    await worker.start()

    def kill():
        os.kill(worker.engine.engine._proc.pid, signal.SIGKILL)

    try:
        names = ["model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"]
        buckets = [
            [(n, torch.full(tuple(_shape(tiny_llama_dir, n)), 0.25 * (i + 1)))] for i, n in enumerate(names)
        ]
        running = asyncio.create_task(
            rollout(
                worker,
                RolloutTask(ROW, (0, 0), "g", "g-s0-a0", 0, seed=1),
                SamplingParams(max_tokens=200, min_tokens=200),
            )
        )
        while worker.engine.engine.num_requests == 0:
            assert not running.done(), running.result()
            await asyncio.sleep(0.01)
        first = worker.engine.engine._proc.pid
        kill()
        while not worker._restart_lock.locked():  # the failed rollout's revival starts a new engine
            assert not running.done(), running.result()
            await asyncio.sleep(0.01)
        refit = asyncio.create_task(
            worker.begin_refit(False)
        )  # meanwhile the refit begins: it must pause the new one
        while not (
            new := [
                p
                for p in psutil.Process().children()
                if p.pid != first
                and p.status() != psutil.STATUS_ZOMBIE
                and "spawn_main" in " ".join(p.cmdline())
            ]
        ):
            await asyncio.sleep(0.01)
        new[0].kill()  # which dies as it starts: the revival starts another
        await refit
        real, killed = worker._buckets, []

        async def killing_after_the_first(refs):
            async for bucket in real(refs):
                yield bucket
                if not killed:
                    killed.append(kill())

        worker._buckets = killing_after_the_first
        await worker.update_weights(buckets, 4)  # the engine dies between its two buckets
        kill()
        await worker.end_refit()  # the resume meets a dead engine
        outcome, _ = await running
        assert outcome.status is RolloutStatus.ENGINE_RESTART and worker.restarts == 3, outcome.error
        assert len(worker._budget.deaths) == 4
        sums = await worker.weight_sums()
        assert await worker.version() == 4 and [sums[n] for n in names] == [
            float(b[0][1].double().sum()) for b in buckets
        ]
        again, payloads = await rollout(
            worker, RolloutTask(ROW, (0, 0), "g", "g-s0-a1", 0, seed=1), SamplingParams(max_tokens=4)
        )
        assert again.ok and {v for p in payloads for v in p["versions"] if v >= 0} == {4}
    finally:
        await worker.stop()


async def test_an_engine_gone_for_good_stops_the_run_with_its_root_cause(tiny_llama_dir, tmp_path):
    """An engine with no process of the worker's to revive (vLLM's EngineCore died: EngineDeadError; here the
    in-process engine closed) ends the run, naming the last error its processes wrote to the worker's stderr,
    which under Ray is a log file (here a file too)."""
    from molt.runtime.worker import RolloutWorker

    log, saved = tmp_path / "worker.err", os.dup(2)
    log.write_text("RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2\n")
    worker = RolloutWorker(str(tiny_llama_dir), str(AGENT), engine_options={"process": False})
    await worker.start()
    try:
        await worker.engine.engine.close()
        fd = os.open(log, os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, 2)
        os.close(fd)
        with pytest.raises(
            RunStopped, match=r"gone for good .*closed.*last error: RuntimeError: Unsupported CPU"
        ):
            await rollout(worker, RolloutTask(ROW, (0, 0), "g", "g-s0-a0", 0), SamplingParams(max_tokens=4))
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        await worker.stop()


async def rollout(worker, task, params):
    """A rollout as the runtime streams it from the worker: the outcome, then its experiences' payloads."""
    outcome, *payloads = [item async for item in worker.run(task, params)]
    return outcome, payloads


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


def test_engine_killed_mid_rollout_is_restarted_and_the_run_goes_on(
    tiny_llama_dir, tmp_path, ray_local, capfd
):
    """Step 3's first env step (4 rollouts of 2 turns a step) kills the engine: that rollout's next model call
    fails, and so does whatever else was in flight on the engine. The restart is said once on the console and
    counted in metrics.jsonl, the step lines and summary.json."""
    out = tmp_path / "run"
    summary = asyncio.run(
        run_training(
            load_config(killer_args(tiny_llama_dir, tmp_path, [17], 5, "--rollout.max_failed_retries", "4"))
        )
    )
    assert summary["steps"] == 5
    check_exactly_once(out, 5)
    metrics = jsonl(out / "metrics.jsonl")
    assert "rollout/failed/engine_restart" not in metrics[1]  # step 2: nothing had failed yet
    counted = metrics[-1]["rollout/failed/engine_restart"]  # the pool's counters are cumulative
    assert 1 <= counted <= 4 and not any(
        k.startswith(("rollout/failed/agent", "rollout/dropped")) for k in metrics[-1]
    )
    retried = [rid for r in ledger(out) for rid in r["rollouts"] if not rid.endswith("-a0")]
    assert len(retried) == counted and all(
        r["step"] >= 3 for r in ledger(out) if set(r["rollouts"]) & set(retried)
    )
    assert (out / "checkpoints" / "step_5" / "state.json").is_file()  # the final checkpoint
    assert [m["engine/restarts"] for m in metrics] == [0, 0, 1, 1, 1]  # told at step 3's refit
    assert summary["faults"] == {
        "engine/restarts": 1,
        "worker/restarts": 0,
        "rollout/failed/engine_restart": counted,
        "rollout/failed/worker_restart": 0,
    }
    console = capfd.readouterr()
    warnings = [line for line in console.err.splitlines() if line.startswith("molt: warning:")]
    restarted = "starting a new one (restart 1 of 3 within 600 s, rollout.engine_max_restarts)"
    assert warnings == [
        f"molt: warning: rollout worker 0: the engine process died (killed by SIGKILL); {restarted}"
    ]
    step_lines = [line for line in console.out.splitlines() if line.startswith("step ")]
    assert ["engine/restarts 1" in line for line in step_lines] == [False, False, True, True, True]


def test_engine_killed_at_each_call_of_a_refit_the_run_goes_on(
    tiny_llama_dir, tmp_path, ray_local, monkeypatch
):
    """A run whose engine process is SIGKILLed before a refit's pause, between its pause and its weights, and
    between its weights and its resume (the refits after steps 1, 2, 3): it trains every step, exactly once."""
    from molt.runtime.worker import Workers

    calls, killed = [], []

    def kill(at):
        if len(calls) == at:
            for pid in descendants(os.getpid()):  # the one live engine, under this process's Ray
                if not gone(pid):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)

    async def refit(actor, partial, refs, version):  # Workers._refit, with the kills
        calls.append(version)
        kill(1)
        await actor.begin_refit.remote(partial)
        try:
            kill(2)
            await actor.update_weights.remote((await refs)[0], version)
            kill(3)
        finally:
            news = await actor.end_refit.remote()
        return news

    monkeypatch.setattr(Workers, "_refit", staticmethod(refit))
    out = tmp_path / "run"
    cfg = load_config(args(tiny_llama_dir, out, 5, "--rollout.engine_max_restarts", "3"))

    async def main():
        run = Run(cfg)
        try:
            await run.setup()
            return await run.train(), await run.workers.actors[0].version.remote()
        finally:
            await run.close()

    summary, version = asyncio.run(main())
    assert summary["steps"] == 5 and version == 5 and len(calls) >= 4 and len(killed) == 3
    assert summary["faults"]["engine/restarts"] == 3
    check_exactly_once(out, 5)


def test_an_engine_crash_loop_stops_the_run_with_a_checkpoint(tiny_llama_dir, tmp_path, ray_local):
    out = tmp_path / "run"
    # from step 2 on every env step kills the engine: no rollout of step 2 can finish
    cfg = load_config(
        killer_args(tiny_llama_dir, tmp_path, range(9, 999), 6, "--rollout.engine_max_restarts", "1")
    )
    with pytest.raises(
        RunStopped, match=r"died \(killed by SIGKILL\), 2 time\(s\) within 600 s.*step 1 is checkpointed"
    ):
        asyncio.run(run_training(cfg))
    # 8 env steps a step: step 2's wait for rollouts is abandoned, step 1 is the checkpoint
    assert len(ledger(out)) == 2 and [p.name for p in (out / "checkpoints").iterdir()] == ["step_1"]
