"""Runs that survive their parts failing (docs/reliability.md), each fault on a tiny real model: what was counted,
what was lost, the exit codes, and that a rerun of the same command resumes with an exactly-once ledger."""

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import psutil
import pytest

from molt.cli import load_config
from molt.runtime.loop import Run, run_training
from molt.runtime.pool import RolloutOutcome, RolloutTask, RunStopped
from molt.types import Experience, RolloutStatus, SamplingParams

ROOT = Path(__file__).parents[2]
AGENT = ROOT / "tests/runtime/agents/letters_env.py"
ROW = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "label": "5"}


# the engine in the worker's own process, for the runs whose faults are not about the engine's process: about
# 5 s less start-up a run on this 2-core machine (tests/runtime/test_train_e2e.py, `_cfg`)
IN_WORKER = "--rollout.no_engine_process"


def args(model_dir, out, steps=6, *extra):
    return [
        "--actor.model_name_or_path",
        str(model_dir),
        "--train.agent_path",
        str(AGENT),
        "--data.prompt_dataset",
        str(ROOT / "recipes/math/data/single_train.jsonl"),
        "--rollout.batch_size",
        "2",
        "--rollout.n_samples_per_prompt",
        "2",
        "--rollout.max_new_tokens",
        "8",
        "--train.max_steps",
        str(steps),
        "--train.max_staleness",
        "0",
        "--ckpt.output_dir",
        str(out),
        "--ray.num_cpus",
        "4",
        *extra,
    ]


def engine_pids(root: int, marker: str = "spawn_main") -> list[int]:
    """The embedded engines' processes (multiprocessing spawn children; or with marker "ray::RolloutWorker", the
    worker actors) among `root`'s descendants only: other people's processes on this machine are never touched."""
    found = []
    for p in psutil.Process(root).children(recursive=True):
        try:
            if marker in " ".join(p.cmdline()):
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
    metric_steps = [
        json.loads(line)["step"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()
    ]
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
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
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
            for pid in engine_pids(os.getpid()):  # the one live engine, under this process's Ray
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


# ------------------------------------------------------------------------------------------- worker actor death
HANGER = """
import asyncio, os, psutil
from molt.agents import Env, Result, StepEnvRunner

MARK = {mark!r}  # the one env step that hangs writes its worker's and engine's pids here


class HangEnv(Env):
    calls = 0

    def __init__(self):
        self.turn = 0

    async def step(self, state):
        HangEnv.calls += 1
        if HangEnv.calls == {hang_at} and not os.path.exists(MARK):  # once per run, not once per worker
            engines = [p.pid for p in psutil.Process().children() if "spawn_main" in " ".join(p.cmdline())]
            with open(MARK + ".tmp", "w") as f:
                f.write(" ".join(map(str, [os.getpid(), *engines])))
            os.rename(MARK + ".tmp", MARK)
            await asyncio.sleep(3600)  # in flight until the test kills this worker
        self.turn += 1
        return Result(reward=state["action_text"].count("e") / 8, observation="Again.", terminated=self.turn == 2)


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(HangEnv)
"""


def gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_workers_replace_a_dead_actor_with_the_last_weights_and_keep_its_payloads(ray_local):
    from molt.runtime.worker import Workers

    class ToyWorker:
        """A stand-in for RolloutWorker's Ray interface: a rollout streams its outcome and one payload, or hangs."""

        def __init__(self):
            self.started, self.loaded = False, None

        async def start(self):
            self.started = True

        async def run(self, task, params, train):
            if task.row.get("hang"):
                await asyncio.sleep(3600)
            yield RolloutOutcome(
                task.rollout_id,
                task.group_id,
                experiences=[Experience(task.rollout_id, task.group_id, 0, 1.0, 1, 1, 0)],
            )
            yield {"token_ids": [len(task.rollout_id)]}

        async def begin_refit(self, partial):
            pass

        async def update_weights(self, bucket_refs, version):
            self.loaded = [await ref for ref in bucket_refs], version

        async def end_refit(self):
            return []  # no engine restarts to tell

        async def state(self):
            return self.started, self.loaded

    def task(rid, **row):
        return RolloutTask(row, (0, 0), "g", rid, 0)

    async def hung(workers):
        running = asyncio.create_task(workers.run(task("hung", hang=True), SamplingParams(), True))
        while not workers.inflight[0]:
            await asyncio.sleep(0.01)
        ray_local.kill(workers.actors[0])  # what an OOM kill or a lost node does to it
        return await running

    async def main():
        workers = Workers(
            lambda i, n: ray_local.remote(max_concurrency=100)(ToyWorker).remote(), 1, max_restarts=1
        )
        await workers.actors[0].start.remote()
        refs = asyncio.ensure_future(
            asyncio.sleep(0, [[ray_local.put("bucket-7")]])
        )  # the trainer ranks' refs
        await workers.refit(False, refs, 7)
        done = await workers.run(task("done"), SamplingParams(), True)
        first = workers.actors[0]
        failed = await hung(workers)
        assert failed.status is RolloutStatus.WORKER_RESTART and failed.rollout_id == "hung"
        assert workers.actors[0] is not first
        assert await workers.actors[0].state.remote() == (
            True,
            (["bucket-7"], 7),
        )  # started, with the last weights
        assert await done.experiences[0].payload_ref == {"token_ids": [4]}  # outlived the worker that made it
        assert (await workers.run(task("next"), SamplingParams(), True)).ok
        with pytest.raises(
            RunStopped, match=r"rollout worker 0 died \(ActorDiedError\), 2 time\(s\) within 600 s"
        ):
            await hung(workers)  # a second death within the window: one more than max_restarts
        ray_local.kill(workers.actors[0])

    asyncio.run(main())


FOREVER = """
from openai import AsyncOpenAI
from molt.agents import ChatAgent, ChatAgentRunner


class Forever(ChatAgent):
    async def run(self, ctx):  # long model calls, one after another, until cancelled
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        while True:
            await client.chat.completions.create(model=ctx.model_name, messages=list(ctx.messages))


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(Forever)
"""


def test_a_rollout_cancelled_on_the_controller_ends_on_its_worker(tiny_llama_dir, tmp_path, ray_local):
    """A dropped rollout (a failed group's sibling, a stopped pool) frees its worker: the agent task, its HTTP
    request into the capture server and its engine request end; `Workers.inflight` is right."""
    from molt.runtime.worker import RolloutWorker, Workers

    agent = tmp_path / "forever.py"
    agent.write_text(FOREVER)

    def probe(worker):  # runs inside the actor
        return worker.engine.engine.num_requests, len(worker.server.sessions)

    async def main():
        spawn = partial(
            ray_local.remote(num_cpus=0, max_concurrency=100)(RolloutWorker).remote,
            str(tiny_llama_dir),
            str(agent),
            engine_options={"process": False},
        )
        workers = Workers(lambda i, n: spawn(), 1, max_restarts=0)
        actor = workers.actors[0]
        await actor.start.remote()
        try:
            running = asyncio.create_task(
                workers.run(
                    RolloutTask(ROW, (0, 0), "g", "g-s0-a0", 0),
                    SamplingParams(max_tokens=400, min_tokens=400),
                    True,
                )
            )
            while await actor.__ray_call__.remote(probe) != (1, 1):  # mid-generation
                assert not running.done(), running.result()
                await asyncio.sleep(0.05)
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            assert workers.inflight == [0]
            for _ in range(100):  # the worker learns of it through Ray: soon, not at once
                if await actor.__ray_call__.remote(probe) == (0, 0):
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)  # and no new request follows: the agent itself ended
            assert await actor.__ray_call__.remote(probe) == (0, 0)
        finally:
            await actor.stop.remote()
            ray_local.kill(actor)

    asyncio.run(main())


def run_killing_a_worker(model_dir, tmp_path, steps, *extra):
    """A run whose step 3 hangs in its first env step (4 rollouts of 2 turns a step) until the test `ray.kill`s
    the worker actor it runs on, once the step's 3 other rollouts are done (their experiences were made by that
    worker); returns (summary, whether the worker was replaced, its version), (worker pid, engine pid)."""
    agent, mark = tmp_path / "hang_env.py", tmp_path / "hanging"
    agent.write_text(HANGER.format(mark=str(mark), hang_at=17))
    cfg = load_config(args(model_dir, tmp_path / "run", steps, "--train.agent_path", str(agent), *extra))

    async def main():
        run = Run(cfg)
        try:
            await run.setup()
            dead = run.workers.actors[0]
            when(lambda: mark.exists() and run.workers.inflight == [1], lambda: ray.kill(dead))
            summary = await run.train()
            return summary, run.workers.actors[0] is not dead, await run.workers.actors[0].version.remote()
        finally:
            await run.close()

    import ray

    return asyncio.run(main()), [int(pid) for pid in mark.read_text().split()]


def test_a_killed_worker_actor_is_replaced_and_the_run_goes_on(tiny_llama_dir, tmp_path, ray_local):
    out = tmp_path / "run"
    (summary, replaced, version), (worker_pid, engine_pid) = run_killing_a_worker(tiny_llama_dir, tmp_path, 5)
    assert summary["steps"] == 5 and replaced and version == 5  # the new worker took every later refit
    check_exactly_once(out, 5)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert not any("worker_restart" in k for k in metrics[1])  # step 2: nothing had failed yet
    # nothing else failed or was dropped: no `stale` group, so the new worker had the current weights' version
    assert [
        (k, v) for k, v in metrics[-1].items() if k.startswith(("rollout/failed", "rollout/dropped"))
    ] == [("rollout/failed/worker_restart", 1)]
    assert (metrics[-1]["worker/restarts"], summary["faults"]["worker/restarts"]) == (1, 1)
    # the hung rollout was re-run on the new worker; the 3 done before the kill were trained from their payloads
    (retried,) = [(r["step"], rid) for r in ledger(out) for rid in r["rollouts"] if not rid.endswith("-a0")]
    assert retried[0] == 3 and retried[1].endswith("-a1")
    assert gone(worker_pid)
    when_gone = threading.Event()  # the dead worker's engine process noticed its parent's end and exited
    when(lambda: gone(engine_pid), when_gone.set, poll=0.1)
    assert when_gone.wait(60)


def test_a_worker_death_past_the_limit_stops_the_run_with_a_checkpoint(tiny_llama_dir, tmp_path, ray_local):
    out = tmp_path / "run"
    with pytest.raises(
        RunStopped,
        match=r"rollout worker 0 died \(ActorDiedError.*\), 1 time\(s\) within 600 s; "
        r"the run survives 0 .*step 2 is checkpointed",
    ):
        run_killing_a_worker(tiny_llama_dir, tmp_path, 6, "--rollout.worker_max_restarts", "0", IN_WORKER)
    assert len(ledger(out)) == 4 and [p.name for p in (out / "checkpoints").iterdir()] == ["step_2"]


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


def test_a_dead_trainer_rank_stops_the_run_and_a_rerun_resumes_exactly_once(
    tiny_llama_dir, tmp_path, ray_local
):
    out = tmp_path / "run"
    cfg = load_config(args(tiny_llama_dir, out, 5, "--ckpt.save_steps", "2", IN_WORKER))

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
    summary = asyncio.run(
        run_training(load_config(args(tiny_llama_dir, out, 5, "--ckpt.save_steps", "2", IN_WORKER)))
    )
    assert summary["steps"] == 5
    check_exactly_once(out, 5)


# ------------------------------------------------------------------------------------------- no progress
RAISER = """
from molt.agents import ChatAgent, ChatAgentRunner


class Broken(ChatAgent):
    async def run(self, ctx):
        raise KeyError("the agent's own bug")


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(Broken)
"""


def test_an_agent_that_always_raises_stops_the_run_with_its_traceback(tiny_llama_dir, tmp_path):
    """With the defaults (all of the last 64 rollouts failed) and a stall limit as a backstop."""
    agent, out = tmp_path / "broken.py", tmp_path / "run"
    agent.write_text(RAISER)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "molt.cli",
            "train",
            *args(
                tiny_llama_dir,
                out,
                4,
                IN_WORKER,
                "--train.agent_path",
                str(agent),
                "--rollout.timeout_s",
                "60",
                "--train.stall_timeout_s",
                "120",
            ),
        ],
        check=False,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    # the first error, once, with the agent's traceback; the reason and the checkpoint in the last line
    assert proc.stderr.count("molt: first agent_error failure") == 1, proc.stderr
    assert 'broken.py", line 7, in run\n    raise KeyError' in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "64 of the last 64 rollouts failed" in last and 'KeyError: "the agent\'s own bug"' in last, last
    assert "step 0 is checkpointed" in last and (out / "checkpoints" / "step_0" / "state.json").is_file()


# ------------------------------------------------------------------------------------------- signals, run directory
def test_sigint_checkpoints_exits_130_and_the_same_command_resumes(tiny_llama_dir, tmp_path, ray_local):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "molt.cli", "train", *args(tiny_llama_dir, out)],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    when(lambda: len(ledger(out)) >= 4, lambda: os.killpg(proc.pid, signal.SIGINT))  # Ctrl-C: the whole group
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode == 130, err
    assert "stopped by SIGINT; step" in err
    stopped = len(ledger(out)) // 2
    assert 2 <= stopped < 6 and (out / "checkpoints" / f"step_{stopped}" / "state.json").is_file()
    summary = asyncio.run(run_training(load_config(args(tiny_llama_dir, out))))
    assert summary["steps"] == 6
    check_exactly_once(out, 6)


def test_sigterm_checkpoints_without_the_rollout_side(tiny_llama_dir, tmp_path):
    """What a Slurm requeue does: SIGTERM to the driver while the rollout side dies (its workers and engines
    get SIGKILL at that moment): the step in progress is checkpointed by the trainer alone, exit 143, and the
    same command resumes it exactly once."""
    out, sent = tmp_path / "run", []

    def requeue():
        rollout_side = engine_pids(proc.pid, "ray::RolloutWorker") + engine_pids(proc.pid)
        proc.send_signal(signal.SIGTERM)
        sent.append(time.time())  # as the checkpoint's file times
        for pid in rollout_side:
            os.kill(pid, signal.SIGKILL)

    proc = subprocess.Popen(
        [sys.executable, "-m", "molt.cli", "train", *args(tiny_llama_dir, out, 400)],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    when(lambda: len(ledger(out)) >= 4, requeue)
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode == 128 + signal.SIGTERM, err
    stopped = len(ledger(out)) // 2
    state = out / "checkpoints" / f"step_{stopped}" / "state.json"
    assert 2 <= stopped < 400 and state.is_file()
    print(f"checkpoint complete {state.stat().st_mtime - sent[0]:.1f} s after SIGTERM")
    assert not any(k.startswith("dropped") for k in json.loads(state.read_text())["counters"])  # nothing lost
    summary = asyncio.run(run_training(load_config(args(tiny_llama_dir, out, stopped + 2))))
    assert summary["steps"] == stopped + 2
    check_exactly_once(out, stopped + 2)


def test_a_repeated_sigterm_changes_nothing_a_sigint_then_exits_at_once(tiny_llama_dir, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "molt.cli", "train", *args(tiny_llama_dir, out, 400, IN_WORKER)],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    when(lambda: len(ledger(out)) >= 2, lambda: proc.send_signal(signal.SIGTERM))
    for (
        line
    ) in proc.stderr:  # the first signal is acknowledged; a second SIGTERM changes nothing, SIGINT ends it
        if "stopping after the step in progress" in line:
            proc.send_signal(signal.SIGTERM)  # as Slurm's TERM to the job does, through its script
            proc.send_signal(signal.SIGINT)
            break
    proc.wait(timeout=120)
    os.killpg(proc.pid, signal.SIGKILL) if psutil.pid_exists(proc.pid) else None
    assert proc.returncode == 128 + signal.SIGINT


def test_a_run_directory_holds_one_run(tiny_llama_dir, tmp_path, capsys):
    from molt.config_resolve import override, resolve, save_config, to_dict
    from molt.runtime.checkpoints import resume_point
    from molt.runtime.data import run_prompts

    out = tmp_path / "run"
    out.mkdir()
    (out / "ledger.jsonl").write_text('{"step": 1, "key": [0, 3], "group_id": "e0-p3", "rollouts": []}\n')
    with pytest.raises(ValueError, match="holds another run .* no complete checkpoint"):
        asyncio.run(Run(load_config(args(tiny_llama_dir, out))).setup())
    # the run itself (its saved config.yaml, as Run.setup saves it) stopped before its first checkpoint
    cfg = load_config(args(tiny_llama_dir, out))
    cfg = resolve(cfg, len(run_prompts(cfg)[0]))
    save_config(cfg, out / "config.yaml")
    with pytest.raises(ValueError, match="holds another run"):  # other settings: another run
        resume_point(out, out / "checkpoints", True, to_dict(override(cfg, {"train.max_steps": 7})))
    requeued = to_dict(override(cfg, {"ray.address": "10.0.0.2:6379"}))  # a requeued job on another node
    assert resume_point(out, out / "checkpoints", True, requeued) is None
    assert "starting it over" in capsys.readouterr().err and not (out / "ledger.jsonl").exists()
    (out / "ledger.jsonl").write_text('{"step": 1, "key": [0, 3], "group_id": "e0-p3", "rollouts": []}\n')
    (out / "checkpoints" / "step_1").mkdir(parents=True)
    (out / "checkpoints" / "step_1" / "state.json").write_text("{}")
    with pytest.raises(ValueError, match="ckpt.resume is off"):
        asyncio.run(Run(load_config(args(tiny_llama_dir, out, 6, "--ckpt.no-resume"))).setup())


# ------------------------------------------------------------------------------------------- non-finite steps
def _model(ckpt: Path) -> dict:
    """The policy's parameters in a trainer checkpoint (DCP)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt / "trainer", ckpt / "flat.pt")
    state = torch.load(ckpt / "flat.pt", weights_only=False)
    return {"step": state["train"]["step"], **state["train"]["model"]}


def _same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)


def test_nan_losses_are_skipped_counted_and_three_in_a_row_stop_the_run(tiny_llama_dir, tmp_path):
    """The trainer's test-only hook adds NaN to the loss of optimizer windows 2, 4, 5 and 6 (one a step): step 2
    is skipped and the run goes on; steps 4-6 are train.max_skipped_steps (3, the default) in a row: the run stops
    with a checkpoint of the last finite weights (step 3's) and exit 1. A process of its own: the hook's variable
    reaches the trainer actors through a Ray instance started with it."""
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "molt.cli",
        "train",
        *args(tiny_llama_dir, out, 8, IN_WORKER, "--ckpt.save_steps", "1", "--ckpt.max_num", "0"),
    ]
    proc = subprocess.run(
        cmd,
        check=False,
        env={**os.environ, "MOLT_FAULT_NAN_LOSS": "2,4,5,6"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert (
        "3 optimizer steps in a row were skipped for a non-finite loss or gradient norm (train.max_skipped_steps "
        "3); the weights are those of the last finite step; step 6 is checkpointed"
    ) in proc.stderr
    metrics = {m["step"]: m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert [metrics[s]["train/skipped_steps"] for s in range(1, 7)] == [0, 1, 0, 1, 1, 1] and max(
        metrics
    ) == 6
    assert math.isnan(metrics[2]["policy_loss"]) and math.isfinite(
        metrics[3]["policy_loss"]
    )  # kept as values
    line = next(x for x in proc.stdout.splitlines() if x.startswith("step 2:"))
    assert "loss nan" in line and "WARNING: 1 optimizer step(s) skipped for a non-finite loss" in line
    check_exactly_once(out, 6)  # the skipped steps' groups are consumed, as any trained group
    models = {s: _model(out / "checkpoints" / f"step_{s}") for s in (1, 2, 3, 6)}
    assert _same(models[1], models[2]) and _same(models[3], models[6]) and models[6]["step"] == 2
    assert not _same(models[2], models[3])  # step 3 trained
