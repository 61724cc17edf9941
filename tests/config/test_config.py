"""Configuration: YAML recipe + dotted overrides with the reference's flag names, validated with clear errors."""

import copy
from pathlib import Path

import pytest

from molt.algo import estimator_spec
from molt.cli import load_config
from molt.config import MoltConfig
from molt.config_resolve import override, resolve, save_config, to_dict
from molt.config_validate import validate


def _files(tmp_path):
    agent = tmp_path / "agent.py"
    agent.write_text("")
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "hi", "label": "1"}\n')
    return ["--train.agent_path", str(agent), "--data.prompt_dataset", str(data)]


def test_yaml_then_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "actor:\n  adam:\n    lr: 3.0e-6\nrollout:\n  n_samples_per_prompt: 4\n  temperature: 0.7\n"
    )
    cfg = load_config(
        [
            "--config",
            str(recipe),
            "--rollout.temperature",
            "0.9",
            "--algo.advantage.is_correction_threshold",
            "0.5",
            "1.5",
            "--algo.advantage.estimator",
            "rloo",
            "--train.partial_rollout_enable",
        ]
        + _files(tmp_path)
    )
    assert cfg.actor.adam.lr == 3e-6 and cfg.rollout.n_samples_per_prompt == 4  # from YAML
    assert cfg.rollout.temperature == 0.9  # flag beats YAML
    assert cfg.algo.advantage.is_correction_threshold == (0.5, 1.5)
    assert cfg.algo.advantage.estimator == "rloo" and cfg.train.partial_rollout_enable
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(["--config", str(tmp_path / "config.yaml")])
    assert again == cfg  # the saved resolved config reproduces the run


@pytest.mark.parametrize(
    "args, field",
    [
        (["--rollout.n_samples_per_prompt", "0"], "rollout.n_samples_per_prompt"),
        (["--rollout.temperature", "-1"], "rollout.temperature"),
        (["--train.max_staleness", "-1"], "train.max_staleness"),
        (["--algo.advantage.is_correction_threshold", "2", "1"], "is_correction_threshold"),
        (
            ["--train.partial_rollout_enable", "--algo.advantage.is_correction_level", "off"],
            "partial_rollout_enable",
        ),
        (["--train.batch_size", "3"], "train.batch_size"),
        (["--algo.kl.init_coef", "0.1", "--algo.kl.estimator", "k1"], "algo.kl.estimator k1"),
        (["--algo.kl.init_coef", "0.1", "--algo.kl.no-use-loss"], "algo.kl.use_loss false"),  # with grpo
        (["--rollout.max_failed_share", "0"], "rollout.max_failed_share"),
        (
            ["--rollout.timeout_s", "7200"],
            r"train.stall_timeout_s \(3600.0\) must be 0 \(never\) or more than rollout",
        ),
        # vLLM's log-probs come after the truncation, the trainer's before (docs/algo.md)
        (["--rollout.engine", "vllm", "--rollout.top_p", "0.9"], "rollout.top_p < 1 or rollout.top_k > 0"),
        (["--rollout.engine", "vllm", "--rollout.top_k", "20"], "is_correction_level off"),
    ],
)
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


GRPO_MEDIAN = Path(__file__).parents[1] / "data" / "grpo_median.py"  # docs/algo.md's example, a user's file


def test_num_ranks_beyond_an_optimizer_steps_rollouts_is_refused_at_validation(tmp_path):
    # 4 prompts x 2 samples a step, 2 rollouts an optimizer step: 4 ranks would leave two without a rollout
    with pytest.raises(ValueError, match=r"train.num_ranks \(4\) exceeds train.batch_size \(2\)"):
        load_config(
            [
                "--rollout.batch_size",
                "4",
                "--rollout.n_samples_per_prompt",
                "2",
                "--train.batch_size",
                "2",
                "--train.num_ranks",
                "4",
                *_files(tmp_path),
            ]
        )


def test_num_ranks_is_checked_against_what_an_optimizer_step_takes():
    rl, sft = MoltConfig(), MoltConfig()
    rl.rollout.batch_size, rl.rollout.n_samples_per_prompt, rl.train.batch_size, rl.train.num_ranks = (
        2,
        2,
        0,
        8,
    )
    with pytest.raises(
        ValueError, match=r"num_ranks \(8\) exceeds rollout.batch_size x n_samples_per_prompt \(4\)"
    ):
        validate(rl, check_files=False)
    # molt sft: chats per step decide, the rollout sizes do not (they used to refuse 2 ranks here)
    sft.rollout.batch_size, sft.rollout.n_samples_per_prompt, sft.train.batch_size, sft.train.num_ranks = (
        1,
        1,
        4,
        2,
    )
    validate(sft, check_files=False, sft=True)
    sft.train.num_ranks = 8
    with pytest.raises(ValueError, match=r"num_ranks \(8\) exceeds train.batch_size \(4\), the chats"):
        validate(sft, check_files=False, sft=True)


def test_validate_changes_nothing_and_resolve_derives_on_a_copy():
    for estimator in ("on_policy_distill", "gae"):
        cfg = MoltConfig()
        cfg.algo.advantage.estimator, cfg.ref.model_name_or_path = estimator, "t"
        before = copy.deepcopy(cfg)
        validate(cfg, check_files=False)
        assert cfg == before, estimator  # the implied settings are resolve()'s
        run = resolve(cfg, num_prompts=10)
        assert cfg == before and run.critic.model_name_or_path == cfg.actor.model_name_or_path
        assert run.train.max_steps == 5 and run.actor.total_steps == 5  # 10 prompts, rollout.batch_size 2
    assert (run.algo.kl.use_loss, run.algo.kl.init_coef) == (True, 0.0)  # gae: as given
    distill = resolve(override(cfg, {"algo.advantage.estimator": "on_policy_distill"}))
    assert (distill.algo.kl.use_loss, distill.algo.kl.estimator, distill.algo.kl.init_coef) == (
        False,
        "k1",
        1.0,
    )


def test_the_python_api_and_the_cli_given_nothing_build_the_same_trainer(tmp_path, tiny_llama_dir):
    """`molt train` given a model, an agent and data, and `Actor.from_pretrained` given the model: the same trainer
    settings field by field, but for what the command line was given and the run length counted from its data."""
    from molt.trainer import Actor

    cli = resolve(
        load_config(["--actor.model_name_or_path", str(tiny_llama_dir), *_files(tmp_path)]), num_prompts=1
    )
    api = Actor.from_pretrained(tiny_llama_dir)
    flat = [_flat(to_dict(c)) for c in (cli, api.cfg)]
    differ = {k for k in flat[0] if flat[0][k] != flat[1][k]}
    assert differ == {
        "train.agent_path",
        "data.prompt_dataset",
        "train.max_steps",
        "actor.total_steps",
        "critic.total_steps",
    }, {k: (flat[0][k], flat[1][k]) for k in differ}
    built = Actor(cli)  # what the trainer ranks of `molt train` build
    for name in ("param_dtype", "device", "share_prefix", "loss_params"):
        assert getattr(built, name) == getattr(api, name), name
    groups = [
        [{k: v for k, v in g.items() if k != "params"} for g in a.optimizers[0].param_groups]
        for a in (built, api)
    ]
    assert groups[0] == groups[1]


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        out.update(
            _flat(value, f"{prefix}{key}.") if isinstance(value, dict) and value else {prefix + key: value}
        )
    return out


def test_a_registered_estimator_is_selectable_from_the_command_line(tmp_path):
    plugin = GRPO_MEDIAN
    with pytest.raises(
        ValueError, match=r"algo.advantage.estimator: unknown advantage estimator 'nope'.*'rloo'"
    ):
        load_config(["--algo.advantage.estimator", "nope", *_files(tmp_path)])  # the registered names listed
    cfg = load_config(
        ["--algo.plugins", str(plugin), "--algo.advantage.estimator", "grpo_median", *_files(tmp_path)]
    )
    assert estimator_spec(cfg.algo.advantage.estimator).kind == "group"
    with pytest.raises(ValueError, match="algo.kl.use_loss false"):  # a group estimator takes no KL reward
        load_config(
            [
                "--algo.plugins",
                str(plugin),
                "--algo.advantage.estimator",
                "grpo_median",
                "--algo.kl.init_coef",
                "0.1",
                "--algo.kl.no-use-loss",
                *_files(tmp_path),
            ]
        )
