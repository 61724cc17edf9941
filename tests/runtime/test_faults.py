"""Runs that survive a worker, a trainer rank or an agent failing (docs/reliability.md; the engine's faults are in
test_engine_faults.py, signals in test_signals.py), each on a tiny real model: what was counted, what was lost, the
exit codes, and that a rerun of the same command resumes with an exactly-once ledger."""

import asyncio
import math
import os
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path

import pytest
from fault_runs import IN_WORKER, ROW, args, ledger

from molt.cli import load_config
from molt.runtime.loop import Run, run_training
from molt.runtime.pool import RolloutOutcome, RolloutTask, RunStopped
from molt.testing.runs import check_exactly_once, gone, jsonl, when
from molt.types import Experience, RolloutStatus, SamplingParams

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
    metrics = jsonl(out / "metrics.jsonl")
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
    metrics = {m["step"]: m for m in jsonl(out / "metrics.jsonl")}
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
