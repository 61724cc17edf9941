"""Every flag of the reference's `train_rl_ray` parses under its name: honoured as a Molt field, mapped onto one,
or dropped with one line saying why (tests/data holds the reference's flag list and its quick-start flag set)."""

import re
from pathlib import Path

import pytest

from molt.cli import load_config
from molt.flags import TABLE, VLLM_ARGS

DATA = Path(__file__).parents[1] / "data"


def reference_flags() -> list[tuple[str, str, str, list[str]]]:
    """(name, type or action, default, choices) of each line of reference-flags.txt."""
    rows = []
    for line in (DATA / "reference-flags.txt").read_text().splitlines():
        if line.startswith("--"):
            name, kind, default, choices = (part.strip() for part in line.split("|", 3))
            rows.append((name[2:], kind, default, re.findall(r'"([^"]+)"', choices)))
    return rows


def sample_argv(name: str, kind: str, default: str, choices: list[str]) -> list[str]:
    """The flag with a value of its type (values within every range Molt validates)."""
    if "store" in kind or "?" in kind or not kind:
        return [f"--{name}"]
    if "nargs=2" in kind:
        return [f"--{name}", "0.5", "1.5"]
    if name == "algo.advantage.is_correction_level":
        return [f"--{name}", "geo"]  # partial_rollout_enable (also given) needs a correction
    if name == "algo.kl.estimator":
        return [f"--{name}", "k2"]  # k1 has no gradient as a loss (use_loss is also given): refused
    value = {"int": "1", "float": "0.5"}.get(kind) or (choices or [default.strip('"') or "x"])[0]
    return [f"--{name}", value if value not in ("None", "") else "x"]


def test_the_data_holds_all_164_flags():
    assert len({name for name, *_ in reference_flags()}) == 164


def test_every_reference_flag_parses(tmp_path, capsys):
    argv = [token for row in reference_flags() for token in sample_argv(*row)]
    cfg = load_config(argv + ["--ckpt.output_dir", str(tmp_path)], check_files=False)
    err = capsys.readouterr().err
    # mapped: same meaning under Molt's names
    assert cfg.actor.policy_loss == "ppo" and cfg.eval.only and cfg.train.max_staleness == 0
    assert cfg.actor.dtype == "bfloat16" and cfg.actor.gradient_checkpoint and not cfg.fsdp.offload
    assert cfg.train.num_ranks == 1 and cfg.train.dump_trajectories_steps == 1 and not cfg.ckpt.export_hf
    # honoured: Molt fields of the reference's names
    assert cfg.critic.value_clip == 0.5 and cfg.data.max_samples == 1 and cfg.reward.clip_range == (0.5, 1.5)
    assert cfg.algo.kl.target == 0.5 and cfg.algo.advantage.no_whiten and cfg.actor.adam.eps == 0.5
    # vLLM knobs pass through to the engine's arguments, and say they do nothing on the embedded engine
    assert (
        cfg.vllm.engine_args["enable_prefix_caching"] == "true" and cfg.vllm.engine_args["block_size"] == "1"
    )
    assert '"num_speculative_tokens": 1' in cfg.vllm.engine_args["speculative_config"]
    lines = err.splitlines()
    assert all(line.startswith("molt: note: --") for line in lines), lines
    said = [line.split()[2] for line in lines]
    assert len(said) == len(set(said)), "one line per flag"
    for name, entry in TABLE.items():  # every flag that has no effect says why, once
        if isinstance(entry, str):
            assert f"--{name}:" in said, name
    for name in (*VLLM_ARGS, "vllm.num_engines", "vllm.gpu_memory_utilization", "data.max_len"):
        assert f"molt: note: --{name}: no effect with the embedded engine (rollout.engine=hf)" in err, name


def test_quickstart_flag_set_parses_unchanged(tmp_path, capsys, quickstart_argv):
    cfg = load_config(
        quickstart_argv(
            MODEL_PATH="m",
            PROMPT_DATASET="d",
            ACTOR_GPUS="1",
            VLLM_TP="1",
            AGENT_FILE="a.py",
            EVAL_DATASET="e",
            SAVE_ROOT=str(tmp_path),
        ),
        check_files=False,
    )
    assert (cfg.data.input_key, cfg.data.label_key, cfg.data.max_samples) == ("prompt", "reward_model", 4800)
    assert cfg.algo.advantage.is_correction_level == "geo" and cfg.algo.advantage.is_correction_threshold == (
        0.99,
        1.01,
    )
    assert cfg.algo.advantage.is_correction_mode == "mask"  # the reference's default mode: a sequence gate
    assert cfg.algo.kl.estimator == "k2" and cfg.algo.kl.use_loss and cfg.algo.kl.init_coef == 0.001
    assert cfg.actor.eps_clip_low_high == (0.2, 0.27) and cfg.actor.dual_clip == 10.0
    assert (
        cfg.reward.clip_range == (-10, 10) and cfg.train.max_epochs == 1 and cfg.ckpt.path.endswith("/state")
    )
    assert "--vllm.gpu_memory_utilization: no effect with the embedded engine" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--fsdp.param_dtype", "fp16"], "fsdp.param_dtype fp16"),
        (["--data.prompt_dataset", "missing.parquet"], "no such file: missing.parquet"),
    ],
)
def test_mistakes_name_the_flag(tmp_path, argv, message):
    agent = tmp_path / "agent.py"
    agent.write_text("")
    with pytest.raises(ValueError, match=message):
        load_config(["--train.agent_path", str(agent), "--data.prompt_dataset", "x.jsonl", *argv])


def test_gradient_checkpoint_and_offload_take_the_reference_values():
    for argv, on in (
        (["--actor.gradient_checkpoint", "full"], True),
        (["--actor.gradient_checkpoint", "none"], False),
        (["--actor.gradient_checkpoint"], True),
    ):
        assert load_config(argv, check_files=False).actor.gradient_checkpoint is on
    assert load_config(["--fsdp.offload", "optimizer"], check_files=False).fsdp.offload
    assert not load_config(["--fsdp.offload", "none"], check_files=False).fsdp.offload
    cfg = load_config(
        ["--actor.num_nodes", "2", "--actor.num_gpus_per_node", "4", "--rollout.batch_size", "8"],
        check_files=False,
    )
    assert cfg.train.num_ranks == 8
