"""Environments from the hubs, by name: `--env.id HUB:ID [--env.args JSON]` instead of an agent file.

Two families ride on the existing paths. Where Molt generates (reasoning-gym, GEM, TextArena, SkyRL-gym,
OpenEnv), an adapter turns the environment into a `Game` that `GameRunner` plays on the rollout's capture
session (molt.envs.games); where the environment calls the model itself (verifiers), it gets an OpenAI client
on that session, so its requests are captured token-exact like any black-box agent's (molt.envs.hubs).

Decisions:
- Several ids, comma-separated, are mixed like datasets (`--env.probs`, molt.runtime.data.mix); every row names
  its environment (`row["env"]`, the id as given), so a group never mixes environments, metrics and evaluation
  are per environment, and a checkpoint's prompt-stream position replays the same mixture (rows are a pure
  function of the configuration and seed).
- A hub is loaded where it is checked (cli.load_config: a missing package, an unknown id or a bad argument is
  one ValueError before anything starts) and again in each rollout worker.
- The hub packages are the `envs` extra (all of them install together on Python 3.11: docs/envs.md).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from typing import Any

from molt.agents.contract import Runner
from molt.envs.hubs import ADAPTERS, Hub


def env_specs(id: str, args: str) -> list[tuple[str, dict[str, Any]]]:
    """(id, keyword arguments) of each entry of env.id; ValueError naming the field otherwise."""
    ids = [e.strip() for e in id.split(",") if e.strip()]
    try:
        given = json.loads(args) if args else [{}] * len(ids)
    except json.JSONDecodeError as e:
        raise ValueError(f"env.args: not JSON ({e})") from None
    given = [given] if isinstance(given, dict) else given
    if not (isinstance(given, list) and len(given) == len(ids) and all(isinstance(a, dict) for a in given)):
        raise ValueError(f"env.args: a JSON object, or a list of {len(ids)} objects (one per env.id entry)")
    return list(zip(ids, given))


def load_hub(spec: str, args: Mapping[str, Any]) -> Hub:
    hub, _, name = spec.partition(":")
    cls = ADAPTERS.get(hub)
    if cls is None or not name:
        raise ValueError(f"env.id {spec!r}: HUB:ID, with HUB one of {', '.join(ADAPTERS)}")
    try:
        lib = importlib.import_module(cls.module)
    except ImportError as e:
        raise ValueError(
            f"env.id {spec}: needs the package {cls.package} (pip install -e '.[envs]'): {e}"
        ) from None
    return cls(lib, spec, dict(args))


class EnvRunner(Runner):
    """The runner of a run on hub environments: each row goes to its environment's runner."""

    def __init__(self, specs: list[tuple[str, dict[str, Any]]], *, max_turns: int = 16, timeout=None):
        self.runners = {spec: load_hub(spec, args).runner(max_turns, timeout) for spec, args in specs}

    async def run(self, row, **kwargs):
        return await self.runners[row["env"]].run(row, **kwargs)


def env_rows(
    hubs: list[Hub], size: int, seed: int, eval: bool, dataset: list[dict[str, Any]]
) -> list[list[dict[str, Any]]]:
    """Each environment's rows: the tasks it generates, or `dataset` (data.prompt_dataset's or eval.dataset's
    rows) where it brings none; each row names its environment."""
    out = []
    for hub in hubs:
        rows = hub.rows(size, seed, eval) if size else None
        if rows is None and not dataset and not eval:
            raise ValueError(f"env.id {hub.spec} plays dataset rows: give data.prompt_dataset")
        out.append([{**row, "env": hub.spec} for row in (dataset if rows is None else rows)])
    return out
