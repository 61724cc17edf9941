"""A run stopped by a signal (docs/reliability.md), on a tiny real model: the checkpoint it leaves, its exit code,
that the same command resumes it, and that a run directory holds one run."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from fault_runs import IN_WORKER, args, ledger

from molt.cli import load_config
from molt.runtime.loop import Run, run_training
from molt.testing.runs import check_exactly_once, descendants, when


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
        rollout_side = descendants(proc.pid, "ray::RolloutWorker") + descendants(proc.pid)
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
