"""Configuration: YAML recipe + dotted overrides with the reference's flag names, validated with clear errors."""
import pytest

from molt.config import MoltConfig, load_config, save_config, validate


def _files(tmp_path):
    agent = tmp_path / "agent.py"
    agent.write_text("")
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "hi", "label": "1"}\n')
    return ["--train.agent_path", str(agent), "--data.prompt_dataset", str(data)]


def test_yaml_then_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("actor:\n  adam:\n    lr: 3.0e-6\nrollout:\n  n_samples_per_prompt: 4\n  temperature: 0.7\n")
    cfg = load_config(["--config", str(recipe), "--rollout.temperature", "0.9",
                       "--algo.advantage.is_correction_threshold", "0.5", "1.5",
                       "--algo.advantage.estimator", "rloo", "--train.partial_rollout_enable"] + _files(tmp_path))
    assert cfg.actor.adam.lr == 3e-6 and cfg.rollout.n_samples_per_prompt == 4  # from YAML
    assert cfg.rollout.temperature == 0.9  # flag beats YAML
    assert cfg.algo.advantage.is_correction_threshold == (0.5, 1.5)
    assert cfg.algo.advantage.estimator == "rloo" and cfg.train.partial_rollout_enable
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(["--config", str(tmp_path / "config.yaml")])
    assert again == cfg  # the saved resolved config reproduces the run


@pytest.mark.parametrize("args, field", [
    (["--rollout.n_samples_per_prompt", "0"], "rollout.n_samples_per_prompt"),
    (["--rollout.temperature", "-1"], "rollout.temperature"),
    (["--train.max_staleness", "-1"], "train.max_staleness"),
    (["--algo.advantage.is_correction_threshold", "2", "1"], "is_correction_threshold"),
    (["--train.partial_rollout_enable", "--algo.advantage.is_correction_level", "off"], "partial_rollout_enable"),
    (["--train.batch_size", "3"], "train.batch_size"),
    (["--algo.kl.init_coef", "0.1", "--algo.kl.estimator", "k1"], "algo.kl.estimator k1"),
    (["--algo.kl.init_coef", "0.1", "--algo.kl.no-use-loss"], "algo.kl.use_loss false"),  # with grpo
    (["--rollout.max_failed_share", "0"], "rollout.max_failed_share"),
    (["--rollout.timeout_s", "7200"], r"train.stall_timeout_s \(3600.0\) must be 0 \(never\) or more than rollout"),
])
def test_bad_values_name_the_field(tmp_path, args, field):
    with pytest.raises(ValueError, match=field):
        load_config(args + _files(tmp_path))


def test_missing_files_and_unknown_yaml_keys(tmp_path):
    with pytest.raises(ValueError, match="train.agent_path is required"):
        validate(MoltConfig())
    with pytest.raises(ValueError, match="no such file"):
        load_config(["--train.agent_path", str(tmp_path / "nope.py"), "--data.prompt_dataset", "x"])
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rollout:\n  n_samples: 4\n")
    with pytest.raises(ValueError, match="unknown config field rollout.n_samples"):
        load_config(["--config", str(recipe)])
