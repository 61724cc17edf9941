"""The Agents SDK recipe (recipes/agents_sdk): its data, a scripted tool loop through the SDK's Responses model and
the real capture server (one token-exact segment, reward 1), and one rollout through the tiny real model."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("agents", reason="the OpenAI Agents SDK (openai-agents, `make harness`) is not installed")

from molt.agents import load_agent
from molt.testing.scripted import ScriptedEngine, live_capture_server
from molt.types import SamplingParams

RECIPE = Path(__file__).parents[2] / "recipes" / "agents_sdk"
ROW = {"messages": [{"role": "user", "content": "What is 61 * 65?"}], "label": 3965}


def test_the_data_needs_the_tool():
    # by path, under a name of its own: each recipe has a make_data.py, and a plain import would reuse the first
    spec = importlib.util.spec_from_file_location("agents_sdk_make_data", RECIPE / "make_data.py")
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)

    train, test = make_data.rows(n_train=50, n_test=10, seed=1)
    pairs = [tuple(map(int, re.findall(r"\d+", r["prompt"][0]["content"]))) for r in train + test]
    assert len(set(pairs)) == 60 and make_data.EXAMPLE not in pairs
    assert all(
        12 <= a <= 99 and 12 <= b <= 99 and r["label"] == a * b for (a, b), r in zip(pairs, train + test)
    )


def _scripted(tokenizer):
    """A model that multiplies with the tool, then answers with the tool's result."""

    def reply(prompt_ids, params):
        prompt = tokenizer.decode(prompt_ids)
        last_turn = prompt.rsplit("<|im_start|>", 2)[-2]  # the turn before the generation prompt
        if last_turn.startswith("tool\n"):
            return "It is " + last_turn[len("tool\n") :].split("<|im_end|>")[0]
        a, b = map(int, re.findall(r"\d+", last_turn))
        return f"<tool_call>{json.dumps({'name': 'multiply', 'arguments': {'a': a, 'b': b}})}</tool_call>"

    return reply


async def test_scripted_tool_loop_in_one_segment(tokenizer):
    engine = ScriptedEngine(tokenizer, _scripted(tokenizer), max_model_len=4096)
    async with live_capture_server(engine, tokenizer) as server:
        traj = await load_agent(RECIPE / "agent.py").run(
            ROW, sessions=server, rollout_id="r", group_id="g", sampling_params=SamplingParams(max_tokens=64)
        )
    assert traj.ok, traj.error
    assert traj.reward == 1.0 and traj.info["tool_calls"] == 1 and traj.info["tool_errors"] == 0
    assert [s.break_reason for s in traj.segments] == ["start"]
    text = tokenizer.decode(traj.segments[0].token_ids)
    assert "<|im_start|>tool\n943<|im_end|>" in text  # the worked example's result
    assert "<|im_start|>tool\n3965<|im_end|>" in text and text.endswith("It is 3965<|im_end|>")
    assert sum(traj.segments[0].action_mask) > 0 and len(engine.calls) == 2


async def test_one_rollout_through_the_tiny_model(hf_engine, tokenizer):
    async with live_capture_server(hf_engine, tokenizer) as server:
        traj = await load_agent(RECIPE / "agent.py").run(
            ROW, sessions=server, rollout_id="r", group_id="g", sampling_params=SamplingParams(max_tokens=16)
        )
    assert traj.ok, traj.error  # the random model writes no call: one turn, answered wrong
    assert traj.reward == 0.0 and traj.segments and sum(traj.segments[0].action_mask) > 0
