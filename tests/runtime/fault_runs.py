"""What the tests of runs that survive faults share: the command line of a small run on a tiny model."""

from pathlib import Path

from molt.testing.runs import jsonl

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


def ledger(out) -> list[dict]:
    return jsonl(Path(out) / "ledger.jsonl")
