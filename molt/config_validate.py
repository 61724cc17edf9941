"""`validate`: the pure check of a configuration tree (errors out naming the field, nothing changed).

Design notes and decisions: docs/internals.md, section `molt/config.py`.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from molt.config import MoltConfig


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


# (fields, test, what the test asks) of the plain ranges; a NaN fails every test
_RANGES = (
    (
        (
            "rollout.batch_size",
            "rollout.n_samples_per_prompt",
            "rollout.max_new_tokens",
            "train.num_episodes",
            "train.max_epochs",
            "train.num_ranks",
            "rollout.num_workers",
            "rollout.max_turns",
            "actor.logprob_chunk_size",
            "fsdp.tp_size",
            "train.max_skipped_steps",
        ),
        lambda v: v >= 1,
        ">= 1",
    ),
    (
        (
            "train.max_staleness",
            "train.max_steps",
            "rollout.temperature",
            "train.micro_batch_size",
            "train.max_tokens_per_gpu",
            "actor.lr_warmup_steps",
            "critic.lr_warmup_steps",
            "algo.kl.init_coef",
            "rollout.failure_window",
            "actor.lora_rank",
            "critic.lora_rank",
        ),
        lambda v: v >= 0,
        ">= 0",
    ),
    (("actor.lora_dropout", "critic.lora_dropout"), lambda v: 0 <= v < 1, "in [0, 1)"),
    (("rollout.top_p", "rollout.max_failed_share"), lambda v: 0 < v <= 1, "in (0, 1]"),
    (("actor.min_lr_ratio", "critic.min_lr_ratio"), lambda v: 0 <= v <= 1, "in [0, 1]"),
    (("actor.adam.lr",), lambda v: v > 0, "> 0"),
)


def _choices(cfg: Any, prefix: str = "") -> None:
    """Every Literal field holds one of its values (the Python API bypasses tyro's check)."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value, allowed = getattr(cfg, f.name), typing.get_args(hints[f.name])
        if dataclasses.is_dataclass(value):
            _choices(value, f"{prefix}{f.name}.")
        elif typing.get_origin(hints[f.name]) is Literal and value not in allowed:
            raise ValueError(f"{prefix}{f.name} must be one of {', '.join(allowed)} (got {value!r})")


def validate(cfg: MoltConfig, *, check_files: bool = True, sft: bool = False) -> MoltConfig:
    """Raise ValueError naming the field for anything that cannot run (`molt sft`'s run with `sft`); return cfg,
    unchanged. Registered names are looked up in molt.algo's registries (load_config imports algo.plugins first).
    `check_files`: the agent and plugin files exist (dataset files: molt.cli.load_config, and at load)."""
    from molt.algo import POLICY_LOSSES, estimator_spec
    from molt.capture.tools import get_tool_parser

    _choices(cfg)
    for names, ok, what in _RANGES:
        for name in names:
            if not ok(_get(cfg, name)):
                raise ValueError(f"{name} must be {what} (got {_get(cfg, name)})")
    for name, lookup in (
        ("algo.advantage.estimator", estimator_spec),
        ("actor.policy_loss", POLICY_LOSSES.get_fn),
        ("rollout.tool_parser", lambda n: n == "auto" or get_tool_parser(n)),
    ):
        try:
            lookup(_get(cfg, name))
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    truncated = cfg.rollout.top_p < 1 or cfg.rollout.top_k > 0  # vLLM's log-probs are then not the trainer's
    if truncated and cfg.rollout.engine == "vllm" and cfg.algo.advantage.is_correction_level != "off":
        raise ValueError(
            "rollout.top_p < 1 or rollout.top_k > 0 with rollout.engine vllm needs "
            "algo.advantage.is_correction_level off: vLLM records log-probs after the truncation, "
            "the trainer recomputes them over the full vocabulary (docs/algo.md)"
        )
    if 0 < cfg.train.stall_timeout_s <= cfg.rollout.timeout_s:  # a step waits for whole rollouts
        raise ValueError(
            f"train.stall_timeout_s ({cfg.train.stall_timeout_s}) must be 0 (never) or more than "
            f"rollout.timeout_s ({cfg.rollout.timeout_s}), the time one rollout may take"
        )
    if min(cfg.actor.eps_clip_low_high) < 0:
        raise ValueError(
            f"actor.eps_clip_low_high must be two numbers >= 0 (got {cfg.actor.eps_clip_low_high})"
        )
    low, high = cfg.algo.advantage.is_correction_threshold
    if not 0 <= low < high:
        raise ValueError(
            f"algo.advantage.is_correction_threshold must satisfy 0 <= LOW < HIGH (got {low} {high})"
        )
    if cfg.train.partial_rollout_enable and cfg.algo.advantage.is_correction_level == "off":
        raise ValueError(
            "train.partial_rollout_enable needs importance correction: set "
            "algo.advantage.is_correction_level to token, seq or geo"
        )
    kl, estimator = cfg.algo.kl, cfg.algo.advantage.estimator
    distill = estimator == "on_policy_distill"  # its KL settings are implied (resolve)
    if distill and not cfg.ref.model_name_or_path:
        raise ValueError("ref.model_name_or_path: on_policy_distill needs the teacher model")
    if (
        kl.init_coef and kl.use_loss and kl.estimator == "k1" and not distill
    ):  # fail now, not at the first step
        raise ValueError(
            "algo.kl.estimator k1 has zero expected gradient as a loss: use k2 or k3 with algo.kl.use_loss"
        )
    if kl.init_coef and not kl.use_loss and estimator_spec(estimator).kind == "group":
        raise ValueError(
            f"algo.kl.use_loss false puts the KL into token rewards, which the group estimator "
            f"{estimator} does not take: keep algo.kl.use_loss, or use a token estimator (reinforce, "
            "reinforce_baseline, gae)"
        )
    total = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
    if sft and cfg.train.batch_size < 1:
        raise ValueError("train.batch_size: chats per optimizer step, must be >= 1 for molt sft")
    size, group = cfg.train.batch_size, cfg.rollout.n_samples_per_prompt
    if not sft and size and (total % size or size % group):
        raise ValueError(
            f"train.batch_size ({size}) must divide rollout.batch_size * "
            f"rollout.n_samples_per_prompt ({total}) in whole groups of {group}"
        )
    if cfg.train.num_ranks > (
        size or total
    ):  # checked here, not at the first optimizer step (molt sft: chats)
        what = (
            f"train.batch_size ({size})" if size else f"rollout.batch_size x n_samples_per_prompt ({total})"
        )
        raise ValueError(
            f"train.num_ranks ({cfg.train.num_ranks}) exceeds {what}, the "
            f"{'chats' if sft else 'rollouts'} of an optimizer step: every rank needs one of each"
        )
    for o in ("actor", "critic"):
        _check_lora(cfg, o)
    if cfg.multiagent.adapters and not (cfg.actor.lora_rank and cfg.multiagent.adapter_names()):
        raise ValueError(
            "multiagent.adapters: one adapter per role needs actor.lora_rank > 0 and multiagent.roles"
        )
    if cfg.multiagent.adapters and cfg.train.weight_sync == "collective":
        raise ValueError(
            "train.weight_sync: collective does not carry multiagent.adapters (use object_store)"
        )
    if check_files:
        if cfg.env.id and cfg.train.agent_path:
            raise ValueError(
                "env.id and train.agent_path: give one (an environment of a hub, or an agent file)"
            )
        # distillation: a built-in agent; hub environments bring their own runner and, most of them, tasks
        needed = () if cfg.env.id else ("train.agent_path", "data.prompt_dataset")[distill or sft :]
        for name in needed:
            if not _get(cfg, name):
                raise ValueError(f"{name} is required")
        files = (("train.agent_path", cfg.train.agent_path), *(("algo.plugins", p) for p in cfg.algo.plugins))
        for name, path in files:
            if path and not Path(path).is_file():
                raise ValueError(f"{name}: no such file: {path}")
    return cfg


def _check_lora(cfg: MoltConfig, name: str) -> None:
    o = _get(cfg, name)
    if o.lora_rank and not o.lora_target_modules:
        raise ValueError(f"{name}.lora_target_modules: name at least one module")
    if o.lora_rank and cfg.fsdp.tp_size > 1:  # the tensor-parallel plan splits nn.Linear, not PEFT's wrappers
        raise ValueError(f"fsdp.tp_size > 1 does not compose with {name}.lora_rank")
    # vLLM fuses q/k/v and gate/up into one layer: a refit of part of one would load into a half-empty layer
    fused = [
        g
        for g in ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"})
        if 0 < len(g & set(o.lora_target_modules)) < len(g)
    ]
    if name == "actor" and o.lora_rank and cfg.rollout.engine == "vllm" and fused:
        raise ValueError(
            f"actor.lora_target_modules: vLLM fuses {', '.join(sorted(fused[0]))}: target all or none"
        )
