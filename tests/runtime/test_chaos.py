"""Chaos (`make test-chaos`, minutes): a tiny-model `molt train` run whose engine process is SIGKILLed at a random
step, then again as a later step's refit begins (its ledger lines are written just before the refit; the report
has the kill's delay after them and the refit's seconds, about 0.04), then its rollout worker actor's process (as
an OOM kill would) at a later step, then the whole run is stopped at a later step still (SIGKILL of its process
group, or SIGTERM as a scheduler's preemption would), and the same command is run again until it finishes.
Checked: the ledger has every trained group exactly once and no rollout twice, metrics.jsonl every step once, the
summary and the final checkpoint's optimizer step count equal `train.max_steps`. CHAOS_SEEDS="0 1 2" picks the
seeds; CHAOS_REPORT=PATH appends one JSON line per seed (docs/reliability.md's table)."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
from fault_runs import args, ledger

from molt.testing.runs import check_exactly_once, descendants, gone

# On a quiet machine a step takes about 0.7 s and each kill waits up to 2 s after its step: with 12 steps the run
# is still going when the last kill lands (with 8, a seed's run once ended before its worker's death was found)
STEPS = 12
SEEDS = [int(s) for s in os.environ.get("CHAOS_SEEDS", "0 1 2").split()]


def wait_for(predicate, proc, what, poll=0.2):
    while not predicate():
        assert proc.poll() is None, (
            f"the run ended (rc {proc.returncode}) before {what}: {proc.stderr.read()[-3000:]}"
        )
        time.sleep(poll)


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.parametrize("seed", SEEDS)
def test_chaos_engine_then_run_killed_resumes_exactly_once(tiny_llama_dir, tmp_path, seed):
    rng = random.Random(seed)
    out = tmp_path / "run"
    engine_at, worker_at, run_at = rng.randint(1, 2), rng.randint(4, 5), 6  # after these steps
    refit_at, refit_delay = (
        rng.randint(engine_at + 1, 3),
        rng.uniform(0, 0.03),
    )  # the refit after this step (40 ms)
    how = ["SIGKILL", "SIGTERM"][seed % 2]
    cmd = [
        sys.executable,
        "-m",
        "molt.cli",
        "train",
        *args(
            tiny_llama_dir,
            out,
            STEPS,
            "--ckpt.save_interval_s",
            "5",
            "--train.seed",
            str(seed),
            "--rollout.max_failed_retries",
            "4",
        ),
    ]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    wait_for(lambda: len(ledger(out)) >= 2 * engine_at and descendants(proc.pid), proc, "the engine kill")
    time.sleep(rng.uniform(0, 2))  # anywhere in the next step: generation, training or the refit
    engine = descendants(proc.pid)[0]
    os.kill(engine, signal.SIGKILL)
    wait_for(lambda: len(ledger(out)) >= 2 * refit_at, proc, "the refit's engine kill", poll=0.005)
    time.sleep(refit_delay)
    live = [
        pid for pid in descendants(proc.pid) if not gone(pid)
    ]  # none if the first death is not found yet:
    for pid in live:  # then the refit finds it
        os.kill(pid, signal.SIGKILL)
    wait_for(
        lambda: len(ledger(out)) >= 2 * worker_at and descendants(proc.pid, "ray::RolloutWorker"),
        proc,
        "the worker kill",
    )
    time.sleep(rng.uniform(0, 2))
    os.kill(descendants(proc.pid, "ray::RolloutWorker")[0], signal.SIGKILL)
    wait_for(lambda: len(ledger(out)) >= 2 * run_at, proc, "the run kill")
    time.sleep(rng.uniform(0, 2))
    if how == "SIGKILL":  # the driver, Ray, workers, engines and trainer ranks at once
        os.killpg(proc.pid, signal.SIGKILL)
    else:  # the driver (a `kill PID`, or Slurm's --signal=B:TERM to the batch shell)
        proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=300)[1]
    first_rc, stopped_at = proc.returncode, len(ledger(out)) // 2
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    engine_failures = max(m.get("rollout/failed/engine_restart", 0) for m in metrics)
    refit_s = next(m["timing/broadcast"] for m in metrics if m["step"] == refit_at)
    worker_failures = max(m.get("rollout/failed/worker_restart", 0) for m in metrics)
    assert first_rc == (-signal.SIGKILL if how == "SIGKILL" else 128 + signal.SIGTERM), err[-2000:]
    # found before the run stopped
    assert re.search(r"molt: warning: rollout worker 0 died \(ActorDiedError.*\); starting a new one", err)
    ckpts = sorted(
        int(p.name.split("_")[1])
        for p in (out / "checkpoints").glob("step_*")
        if (p / "state.json").is_file()
    )
    resumed_from = ckpts[-1]
    if how == "SIGTERM":
        assert resumed_from == stopped_at  # the step in progress finished or was abandoned: nothing to redo
    again = subprocess.run(
        cmd, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600
    )
    assert again.returncode == 0, again.stderr[-2000:]
    check_exactly_once(out, STEPS)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == STEPS
    import torch.distributed.checkpoint as dcp

    state = {"train": {"step": -1}}
    dcp.load(state, checkpoint_id=str(out / "checkpoints" / f"step_{STEPS}" / "trainer"))
    assert state["train"]["step"] == STEPS  # one optimizer step a training step: none lost, none repeated
    if os.environ.get("CHAOS_REPORT"):
        with open(os.environ["CHAOS_REPORT"], "a") as f:
            f.write(
                json.dumps(
                    {
                        "seed": seed,
                        "engine_killed_in_step": engine_at + 1,
                        "refit_kill_after_step": refit_at,
                        "refit_kill_delay_s": round(refit_delay, 3),
                        "refit_s": round(refit_s, 3),
                        "refit_killed_a_live_engine": bool(live),
                        "worker_killed_in_step": worker_at + 1,
                        "worker_restart_failures": worker_failures,
                        "run_killed": how,
                        "run_killed_in_step": run_at + 1,
                        "first_rc": first_rc,
                        "stopped_at": stopped_at,
                        "resumed_from": resumed_from,
                        "steps_redone": stopped_at - resumed_from,
                        "engine_restart_failures": engine_failures,
                        "faults": summary["faults"],  # restarts counted up to the last checkpoint
                        "final_rc": again.returncode,
                        "final_steps": summary["steps"],
                        "optimizer_steps": state["train"]["step"],
                        "seconds": round(time.perf_counter() - t0),
                    }
                )
                + "\n"
            )
