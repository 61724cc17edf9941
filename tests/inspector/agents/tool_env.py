"""Test Env for the inspector: the two-turn `LettersEnv` of tests/runtime, its observation sent as a tool
result (a `tool` turn of the chat template)."""

import importlib.util
from pathlib import Path

from molt.agents import StepEnvRunner

_spec = importlib.util.spec_from_file_location(
    "letters_env", Path(__file__).parents[2] / "runtime" / "agents" / "letters_env.py"
)
letters = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(letters)


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(letters.LettersEnv, observation_role="tool")
