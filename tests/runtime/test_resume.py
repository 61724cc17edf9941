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

from molt.config import load_config
from molt.runtime.loop import run_training

ROOT = Path(__file__).parents[2]


def _args(model_dir, out):
    return ["--actor.model_name_or_path", str(model_dir), "--train.agent_path",
            str(ROOT / "tests/runtime/agents/letters_env.py"), "--data.prompt_dataset",
            str(ROOT / "recipes/math/data/single_train.jsonl"), "--rollout.batch_size", "2",
            "--rollout.n_samples_per_prompt", "2", "--rollout.max_new_tokens", "8", "--train.max_steps", "6",
            "--train.max_staleness", "0", "--ckpt.save_steps", "1", "--ckpt.output_dir", str(out),
            "--ray.num_cpus", "4"]


def test_killed_run_resumes_with_an_exactly_once_ledger(tiny_llama_dir, tmp_path, ray_local):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "molt.cli", "train", *_args(tiny_llama_dir, out)],
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while not (out / "checkpoints" / "step_2" / "state.json").is_file():
        assert proc.poll() is None and time.time() < deadline, "the first run should reach step 2"
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver, its Ray instance, workers and trainer ranks
    proc.wait()
    killed_at = len((out / "ledger.jsonl").read_text().splitlines()) // 2
    assert 2 <= killed_at < 6

    summary = asyncio.run(run_training(load_config(_args(tiny_llama_dir, out))))
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
