"""The reference's flags of `molt train` rewritten into Molt's (argv in, argv out; `molt.cli.load_config` parses).

Design notes and decisions: docs/internals.md, section `molt/flags.py`.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

Rule = Callable[[list[str], dict[str, list[str]]], list[str]]
OFF = ("none", "false", "off", "0", "no")
_DATA = yaml.safe_load((Path(__file__).parent / "flags.yaml").read_text())


def _to(flag: str, *fixed: str) -> Rule:
    """The same knob under Molt's name; `fixed` replaces the values."""
    return lambda values, given: [f"--{flag}", *(fixed or values)]


def _switch(flag: str) -> Rule:
    """A Molt on/off field from a reference flag that takes an optional mode value (`full`, `none`, ...)."""
    group, _, name = flag.rpartition(".")
    return lambda values, given: [
        f"--{group}.no_{name}" if values and values[0].lower() in OFF else f"--{flag}"
    ]


def _dtype(values: list[str], given: dict[str, list[str]]) -> list[str]:
    if values and values[0] != "bf16":
        raise ValueError(
            f"--fsdp.param_dtype {values[0]}: Molt trains in bf16 or fp32 (actor.dtype); use bf16"
        )
    return ["--actor.dtype", "bfloat16"]


def _attention(values: list[str], given: dict[str, list[str]]) -> list[str]:
    if values and values[0].startswith("flash") and importlib.util.find_spec("flash_attn") is None:
        note(f"--fsdp.attn_implementation {values[0]}: flash_attn is not installed here; sdpa instead")
        return ["--fsdp.attn_implementation", "sdpa"]
    return ["--fsdp.attn_implementation", *values]


def _ranks(values: list[str], given: dict[str, list[str]]) -> list[str]:
    nodes = int((given.get("actor.num_nodes") or ["1"])[0])
    return ["--train.num_ranks", str(nodes * int(values[0]))]


def _nodes(values: list[str], given: dict[str, list[str]]) -> list[str]:
    if "actor.num_gpus_per_node" not in given:
        note(
            "--actor.num_nodes: no effect: trainer ranks are counted by train.num_ranks (or with "
            "actor.num_gpus_per_node, times actor.num_nodes)"
        )
    return []


def _dumps(values: list[str], given: dict[str, list[str]]) -> list[str]:
    note(f"--train.rollout_dump_dir {' '.join(values)}: Molt writes its dumps into <ckpt.output_dir>/dumps")
    return ["--train.dump_trajectories_steps", "1"]


TABLE: dict[str, str | Rule] = {
    # the same knobs under Molt's names or value syntax
    "actor.loss_mode": _to("actor.policy_loss"),
    "actor.gradient_checkpoint": _switch("actor.gradient_checkpoint"),
    "fsdp.offload": _switch("fsdp.offload"),
    "fsdp.param_dtype": _dtype,
    "fsdp.attn_implementation": _attention,
    "actor.num_gpus_per_node": _ranks,
    "actor.num_nodes": _nodes,
    "eval.eval_only": _to("eval.only"),
    "ckpt.load_enable": _to("ckpt.resume"),
    "ckpt.disable_final_save": _to("ckpt.no_export_hf"),
    "ckpt.dcp_max_num": _to("ckpt.max_num"),
    "train.force_on_policy": _to("train.max_staleness", "0"),
    "train.force_sync_mode": _to("train.max_staleness", "0"),
    "train.rollout_dump_dir": _dumps,
    # no effect in this run, and why (data: flags.yaml)
    **_DATA["no_effect"],
}
VLLM_ARGS = _DATA["vllm_args"]  # reference flag -> vllm.AsyncEngineArgs keyword (flags.yaml)
HF_ENGINE = (
    "no effect with the embedded engine (rollout.engine=hf); passed to vLLM with --rollout.engine vllm"
)
INERT = _DATA["inert"]  # Molt fields that parse but do nothing in this version, and why


def note(line: str) -> None:
    print(f"molt: note: {line}", file=sys.stderr)


def _split(argv: list[str]) -> list[tuple[str, list[str]]]:
    """[(flag without dashes or "", its values)]: `--a.b=1` is `--a.b 1`; tokens before any flag keep ""."""
    out: list[tuple[str, list[str]]] = [("", [])]
    for token in argv:
        if token.startswith("--"):
            name, eq, value = token[2:].partition("=")
            out.append((name, [value] if eq else []))
        else:
            out[-1][1].append(token)
    return out


def translate(argv: list[str], fields: set[str]) -> tuple[list[str], dict[str, str], dict[str, list[str]]]:
    """(argv for tyro, vLLM engine args, every flag given with its values) of a reference-style argv.
    `fields`: Molt's dotted field names."""
    pieces = _split(argv)
    given = {name: values for name, values in pieces if name}
    out, engine_args = list(pieces[0][1]), {}
    for name, values in pieces[1:]:
        entry = TABLE.get(name)
        if callable(entry):
            out += entry(values, given)
        elif name in VLLM_ARGS:
            key, _, template = VLLM_ARGS[name].partition("=")
            engine_args[key] = template.format(*values) if template else (values[0] if values else "true")
        elif isinstance(entry, str) and name not in fields:
            note(f"--{name}: no effect: {entry}")
        else:
            out += [f"--{name}", *values]
    return out, engine_args, given


def after_parse(engine: str, given: dict[str, list[str]]) -> None:
    """The lines that depend on the parsed config: engine knobs on the embedded engine; inert fields."""
    for name in given:
        if isinstance(TABLE.get(name), str):
            continue  # said already
        if engine != "vllm" and (name.startswith("vllm.") or name == "data.max_len"):
            note(f"--{name}: {HF_ENGINE}")
        elif name in INERT:
            note(f"--{name}: no effect: {INERT[name]}")


def dotted(tree: dict, prefix: str = "") -> set[str]:
    """Dotted field names of a config as `molt.config_resolve.to_dict` writes it."""
    names: set[str] = set()
    for key, value in tree.items():
        names |= dotted(value, f"{prefix}{key}.") if isinstance(value, dict) and value else {prefix + key}
    return names
