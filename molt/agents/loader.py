"""Loading an agent file by path (`--train.agent_path`).

The file is imported as a fresh module under a unique name (two agent files may share a basename), with its
directory on `sys.path` so that helper modules next to it import the way they do when the file is run
directly. It must define `AgentRunner`, a `Runner` subclass built with no arguments. No path gives the built-in
agent `Generate` (one model turn, reward 0) of on-policy distillation, whose signal is the teacher's.
"""

from __future__ import annotations

import sys
from pathlib import Path

from molt.agents.contract import Env, Result, Runner
from molt.agents.runners import StepEnvRunner
from molt.types import import_file


class Generate(Env):
    async def step(self, state: dict) -> Result:
        return Result()


def load_agent(path: str | Path) -> Runner:
    """Import the agent file at `path` and return `AgentRunner()`; ValueError with the reason otherwise."""
    if not path:
        return StepEnvRunner(Generate, max_turns=1)
    file = Path(path).expanduser().resolve()
    if not file.is_file() or file.suffix != ".py":
        raise ValueError(f"agent path {str(path)!r} is not a .py file")
    folder = str(file.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module = import_file(file, "molt_agent")
    runner_cls = getattr(module, "AgentRunner", None)
    if not (isinstance(runner_cls, type) and issubclass(runner_cls, Runner)):
        raise ValueError(  # noqa: TRY004 - a user mistake, which the CLI reports as such
            f"{file} must define AgentRunner, a subclass of molt.agents.Runner "
            f"(e.g. class AgentRunner(StepEnvRunner) or ChatAgentRunner); found {runner_cls!r}"
        )
    try:
        return runner_cls()
    except TypeError as e:
        raise ValueError(f"{file}: AgentRunner must be constructible with no arguments ({e})") from None
