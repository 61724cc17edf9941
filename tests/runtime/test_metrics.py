"""Per-step metrics reach every configured sink: JSONL, TensorBoard, and W&B offline (in the dev extra)."""

import math

from molt.runtime.metrics import MetricsLogger, read_metrics


def test_jsonl_and_tensorboard_hold_each_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path, 2, tensorboard_dir=str(tmp_path / "tb"))
    logger.log(
        1,
        {
            "rollout/reward_mean": 0.25,
            "timing/step_total": 3.0,
            "policy_loss": math.nan,
            "actor_grad_norm": math.inf,
            "text": "x",
        },
    )
    logger.log(2, {"rollout/reward_mean": 0.5, "timing/step_total": 2.5})
    logger.close()
    rows = read_metrics(tmp_path)
    assert math.isnan(rows[0].pop("policy_loss"))  # a non-finite value is a value: kept, as everywhere below
    assert rows == [
        {"step": 1, "rollout/reward_mean": 0.25, "timing/step_total": 3.0, "actor_grad_norm": math.inf},
        {"step": 2, "rollout/reward_mean": 0.5, "timing/step_total": 2.5},
    ]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("rollout/reward_mean")] == [(1, 0.25), (2, 0.5)]
    assert (
        math.isnan(events.Scalars("policy_loss")[0].value)
        and events.Scalars("actor_grad_norm")[0].value == math.inf
    )


def test_the_step_line_warns_of_skipped_steps_and_a_closed_gate(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, 2)
    logger.log(1, {"policy_loss": 0.5, "train/skipped_steps": 0.0, "is/rejected_frac": 0.998})
    logger.log(
        2,
        {
            "policy_loss": math.nan,
            "actor_grad_norm": math.inf,
            "train/skipped_steps": 1.0,
            "is/rejected_frac": 0.9995,
        },
    )
    logger.close()
    first, second = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert first == "step 1: loss 0.5"
    assert second.startswith(
        "step 2: loss nan | gnorm inf | WARNING: 1 optimizer step(s) skipped for a non-finite"
    )
    assert (
        second.count("WARNING") == 2
        and "WARNING: the importance gate rejected 99.95% of the action tokens" in second
    )


def test_wandb_offline_run_gets_the_config_and_the_steps(tmp_path, monkeypatch):
    import wandb

    # W&B's process-wide setup keeps the settings of an earlier init in this process (the reference quick-start
    # run's, online and without a key, where the suite runs it first): start from none
    wandb.teardown()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(
        tmp_path, 2, wandb={"project": "molt-test", "run_name": "r1"}, config={"actor": {"lr": 1e-5}}
    )
    run = logger._wandb
    logger.log(1, {"rollout/reward_mean": 0.25})
    logger.log(2, {"rollout/reward_mean": 0.75})
    assert run.config["actor"] == {"lr": 1e-5} and run.name == "r1"
    logger.close()  # W&B keeps the latest step open until the next one or the end
    wandb.teardown()  # the service writes the records after finish() returns; teardown waits for it
    (record,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")  # what `wandb sync` uploads later
    data = record.read_bytes()
    assert b"rollout/reward_mean" in data and b"0.75" in data
    assert len(read_metrics(tmp_path)) == 2


def test_wandb_without_the_package_logs_the_rest(tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    logger = MetricsLogger(tmp_path, 1, wandb={"project": "p"})
    logger.log(1, {"rollout/reward_mean": 0.5})
    logger.close()
    assert logger._wandb is None and "wandb is not installed" in capsys.readouterr().err
    assert read_metrics(tmp_path) == [{"step": 1, "rollout/reward_mean": 0.5}]


def test_agent_metrics_by_hand():
    """Two rollouts: 3 parsed calls (1 refused by the tool) and 1 malformed attempt over 6 model calls."""
    from types import SimpleNamespace

    from molt.runtime.metrics import agent_metrics, info_means

    a = SimpleNamespace(
        info={
            "capture/requests": 4.0,
            "capture/tool_calls": 2.0,
            "capture/malformed_tool_calls": 1.0,
            "tool_errors": 1.0,
        }
    )
    b = SimpleNamespace(
        info={"capture/requests": 2.0, "capture/tool_calls": 1.0, "capture/malformed_tool_calls": 0.0}
    )
    m = agent_metrics([a, b], "agent/")
    # turns (4 + 2) / 2; attempts (2 + 1 + 1) / 2; valid = (3 parsed - 1 refused) / 4 attempts
    assert m == {"agent/turns": 3.0, "agent/tool_calls": 2.0, "agent/tool_call_valid": 0.5}
    assert info_means([a, b], "x/")["x/tool_errors"] == 1.0  # the mean over the rollouts that report it
    env = SimpleNamespace(info={"capture/requests": 1.0})
    assert agent_metrics([env], "agent/") == {
        "agent/turns": 1.0,
        "agent/tool_calls": 0.0,
    }  # no calls: no rate
    assert agent_metrics([SimpleNamespace(info={})], "agent/") == {}  # not through the capture server


def test_curves_get_an_agent_panel(tmp_path):
    from PIL import Image

    from molt.runtime.plot import plot_run

    logger = MetricsLogger(tmp_path, 2)
    logger.log(1, {"rollout/reward_mean": 0.1})
    logger.close()
    narrow = Image.open(plot_run(tmp_path)).size
    logger = MetricsLogger(tmp_path, 2)
    logger.log(2, {"rollout/reward_mean": 0.2, "agent/tool_calls": 1.5, "agent/tool_call_valid": 0.5})
    logger.close()
    wide = Image.open(plot_run(tmp_path)).size
    assert wide[0] > narrow[0] and wide[1] == narrow[1]  # a second panel beside the first


def test_wandb_that_cannot_start_leaves_the_run_logging(tmp_path, monkeypatch, capsys):
    import wandb

    def refuse(**kwargs):
        raise wandb.errors.UsageError("No API key configured")

    monkeypatch.setattr(wandb, "init", refuse)
    logger = MetricsLogger(tmp_path, 1, wandb={"project": "p"})
    logger.log(1, {"rollout/reward_mean": 0.5})
    logger.close()
    assert "W&B logging is off: No API key configured" in capsys.readouterr().err
    assert read_metrics(tmp_path) == [{"step": 1, "rollout/reward_mean": 0.5}]


def test_the_step_line_counts_failures_and_drops_by_reason(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, 1)
    logger.log(
        1,
        {
            "rollout/reward_mean": 0.5,
            "rollout/failed/agent_error": 3.0,
            "rollout/failed/timeout": 1.0,
            "rollout/dropped/group_failed": 1.0,
        },
    )
    logger.close()
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("step 1:"))
    assert line.endswith("reward 0.5 | failed/agent_error 3 failed/timeout 1 dropped/group_failed 1"), line
