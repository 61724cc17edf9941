"""The public contract itself: light import, field names, reward conversion, loading agent files."""

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from molt.agents import (
    ChatAgentRunner,
    ChatContext,
    InvalidReward,
    Result,
    Runner,
    StepEnvRunner,
    Trajectory,
    load_agent,
    to_float,
)
from molt.types import Trajectory as SharedTrajectory

EXAMPLES = Path(__file__).parent / "examples"


def test_import_is_light():
    code = (
        "import sys, molt.agents; heavy = [m for m in ('torch', 'fastapi', 'ray', 'uvicorn', 'transformers', "
        "'molt.capture') if m in sys.modules]; print(heavy); sys.exit(bool(heavy))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_contract_fields():
    assert Trajectory is SharedTrajectory
    assert (
        {f.name: f.default for f in dataclasses.fields(Result) if f.default is not dataclasses.MISSING}
        == {
            "reward": 0.0,
            "observation": "",
            "terminated": True,
            "truncated": False,
            "score": None,
            "images": None,
            "sampling_params": None,
            "turn_rewards": None,  # Molt's own (docs/algo.md, "Per-turn rewards"); the reference's fields keep theirs
        }
    )
    assert Result().info == {}
    assert [f.name for f in dataclasses.fields(ChatContext)] == [
        "messages",
        "tools",
        "prompt",
        "label",
        "images",
        "base_url",
        "session_url",
        "model_name",
        "api_key",
        "session_id",
        "sampling_params",
        "max_length",
    ]


@pytest.mark.parametrize(
    "value,expected",
    [
        (1, 1.0),
        (2.5, 2.5),
        (True, 1.0),
        (torch.tensor(0.5), 0.5),
        (torch.tensor([0.25, 9.0]), 0.25),
        (torch.tensor([[3.0]]), 3.0),
        ([0.75, 1], 0.75),
        ((1,), 1.0),
        (torch.tensor([2], dtype=torch.int64), 2.0),
    ],
)
def test_rewards_convert(value, expected):
    assert to_float(value) == expected


@pytest.mark.parametrize(
    "value", [None, "1.0", [], torch.tensor([]), math.nan, torch.tensor(float("inf")), {}]
)
def test_bad_rewards_are_clear_errors(value):
    with pytest.raises(InvalidReward, match="reward"):
        to_float(value)


def test_load_reference_shaped_files():
    assert isinstance(load_agent(EXAMPLES / "chat_agent.py"), ChatAgentRunner)
    assert isinstance(load_agent(str(EXAMPLES / "env_agent.py")), StepEnvRunner)


@pytest.mark.parametrize(
    "source,problem",
    [
        ("x = 1\n", "must define AgentRunner"),
        ("class AgentRunner:\n    pass\n", "subclass of molt.agents.Runner"),
        (
            "from molt.agents import Runner\nclass AgentRunner(Runner):\n    def __init__(self, x):\n        pass\n",
            "no arguments",
        ),
    ],
)
def test_load_errors(tmp_path, source, problem):
    path = tmp_path / "agent.py"
    path.write_text(source)
    with pytest.raises(ValueError, match=problem):
        load_agent(path)


def test_load_rejects_non_python(tmp_path):
    with pytest.raises(ValueError, match="not a .py file"):
        load_agent(tmp_path / "missing.py")


def test_same_basename_in_two_folders(tmp_path):
    runners = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "agent.py").write_text(
            f"from molt.agents import Runner\nclass AgentRunner(Runner):\n    tag = {name!r}\n"
        )
        runners.append(load_agent(tmp_path / name / "agent.py"))
    assert [r.tag for r in runners] == ["a", "b"] and all(isinstance(r, Runner) for r in runners)
