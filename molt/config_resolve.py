"""The configuration tree's derived values and its dotted and YAML forms: `resolve` (a copy with every derived
value, the one place they are computed), `override` (dotted fields: the Python API), `from_dict`/`to_dict`.

Design notes and decisions: docs/internals.md, section `molt/config.py`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from molt.config import MoltConfig


def optimizer_windows(cfg: MoltConfig) -> int:
    """Optimizer steps per pass over a training step's rollouts (`train.batch_size` rollouts each)."""
    total = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
    return total // cfg.train.batch_size if cfg.train.batch_size else 1


def resolve(cfg: MoltConfig, num_prompts: int | None = None, *, sft: bool = False) -> MoltConfig:
    """A copy of `cfg` with the values derived from others filled in: the one place they are computed.
    `num_prompts`: the size of the prompt (`sft`: chat) dataset, over which train.max_steps 0 counts passes."""
    cfg = copy.deepcopy(cfg)
    t, adv, kl = cfg.train, cfg.algo.advantage, cfg.algo.kl
    if (
        not t.max_steps and num_prompts is not None
    ):  # num_episodes passes over the prompts, as the reference counts
        t.max_steps = max(
            1, t.num_episodes * num_prompts // (t.batch_size if sft else cfg.rollout.batch_size)
        )
    if sft:  # the cross entropy of the assistant's tokens: no importance correction, no reference
        cfg.actor.policy_loss, adv.is_correction_level, kl.init_coef = "sft", "off", 0.0
    if adv.estimator == "on_policy_distill":  # the teacher's KL as a token reward, taken as it is
        kl.use_loss, kl.estimator, adv.no_whiten, kl.init_coef = False, "k1", True, kl.init_coef or 1.0
    cfg.critic.model_name_or_path = cfg.critic.model_name_or_path or cfg.actor.model_name_or_path
    windows = 1 if sft else optimizer_windows(cfg)  # sft: one optimizer step a training step
    for o, epochs in ((cfg.actor, t.max_epochs), (cfg.critic, cfg.critic.max_epochs or t.max_epochs)):
        o.total_steps = o.total_steps or t.max_steps * windows * (1 if sft else epochs)
        o.lr_warmup_steps = max(o.lr_warmup_steps, math.ceil(o.lr_warmup_ratio * o.total_steps))
    return cfg


def override(cfg: MoltConfig, values: dict[str, Any]) -> MoltConfig:
    """A copy of `cfg` with dotted fields set, as the command line names them: `{"actor.adam.lr": 1e-5}` (the Python
    API's overrides); an unknown name is an error naming it."""
    nested: dict[str, Any] = {}
    for dotted, value in values.items():
        *groups, name = dotted.split(".")
        node = nested
        for group in groups:
            node = node.setdefault(group, {})
        node[name] = value
    return from_dict(cfg, nested)


def from_dict(base: Any, data: dict[str, Any], prefix: str = "") -> Any:
    """`base` (a config dataclass) with the values of a YAML mapping; unknown keys are errors naming the field."""
    kwargs: dict[str, Any] = {}
    by_name = {f.name: f for f in dataclasses.fields(base)}
    for key, value in (data or {}).items():
        if key not in by_name:
            raise ValueError(f"unknown config field {prefix}{key} (known: {', '.join(sorted(by_name))})")
        default = getattr(base, key)
        if dataclasses.is_dataclass(default):
            if not isinstance(value, dict):
                raise ValueError(f"config field {prefix}{key} must be a mapping")
            value = from_dict(default, value, f"{prefix}{key}.")
        elif isinstance(default, tuple):
            value = tuple(value)
        kwargs[key] = value
    return dataclasses.replace(base, **kwargs)


def to_dict(cfg: Any) -> dict[str, Any]:
    def plain(v: Any) -> Any:
        return (
            list(v)
            if isinstance(v, tuple)
            else {k: plain(x) for k, x in v.items()}
            if isinstance(v, dict)
            else v
        )

    return plain(dataclasses.asdict(cfg))


def save_config(cfg: MoltConfig, path: str | Path) -> None:
    import yaml

    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
