"""The runners through a live capture server: reference-shaped agent files unchanged, failures as statuses,
multi-turn Envs with chat-template observations, limits."""

import asyncio
import sys
from pathlib import Path

import pytest

from molt.agents import ChatAgent, ChatAgentRunner, Env, Result, StepEnvRunner, load_agent
from molt.testing.scripted import RecordingEngine, ScriptedEngine, live_capture_server
from molt.types import RolloutStatus, SamplingParams, sub_seed

EXAMPLES = Path(__file__).parent / "examples"
ROW = {"messages": [{"role": "user", "content": "What is 3 + 4?"}], "label": "7"}


async def run(runner, engine, tokenizer, row=ROW, params=None):
    async with live_capture_server(engine, tokenizer) as server:
        traj = await runner.run(
            row,
            sessions=server,
            rollout_id="r",
            group_id="g",
            sampling_params=params or SamplingParams(max_tokens=8),
        )
        assert not server.sessions  # the runner always closes its session
    return traj


@pytest.mark.parametrize("file", ["chat_agent.py", "anthropic_agent.py"])
async def test_reference_chat_agent_files_run_unchanged(hf_engine, tokenizer, file):
    engine = RecordingEngine(hf_engine)
    traj = await run(load_agent(EXAMPLES / file), engine, tokenizer)
    assert traj.ok, traj.error
    assert traj.reward in (0.0, 1.0) and (traj.rollout_id, traj.group_id) == ("r", "g")
    ((_, prompt, completion),) = engine.records
    (segment,) = traj.segments
    assert segment.token_ids.tolist() == prompt + completion.token_ids
    assert segment.num_actions == len(completion.token_ids)
    assert traj.info["capture/requests"] == 1.0 and traj.info["capture/malformed_tool_calls"] == 0.0
    if file == "chat_agent.py":  # a 1-element tensor in info becomes a float
        assert traj.info["length"] == len(tokenizer.decode(completion.token_ids, skip_special_tokens=True))


async def test_reference_env_file_runs_unchanged(hf_engine, tokenizer):
    runner = load_agent(EXAMPLES / "env_agent.py")
    seen = sys.modules[type(runner).__module__].SEEN
    seen.clear()
    traj = await run(
        runner, RecordingEngine(hf_engine), tokenizer, {"prompt": "What is 3 + 4?", "label": "7"}
    )
    assert traj.ok and traj.reward in (0.0, 1.0)
    ((state),) = seen
    assert set(state) == {"observation_text", "action_text", "label", "sampling_params"}
    (segment,) = traj.segments
    n = int(segment.action_mask.argmax())  # the first action token
    assert state["observation_text"] == tokenizer.decode(segment.token_ids[:n])  # the chat-rendered context
    assert state["observation_text"].endswith(
        "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert state["action_text"] == tokenizer.decode(segment.token_ids[n:])  # special tokens kept
    assert state["label"] == "7" and state["sampling_params"].max_tokens == 8


class Raising(ChatAgent):
    async def run(self, ctx):
        raise RuntimeError("tool crashed")


class Sleeping(ChatAgent):
    async def run(self, ctx):
        await asyncio.sleep(30)


class NoReward(ChatAgent):
    async def run(self, ctx):
        return Result(reward=None)


class NaNReward(ChatAgent):  # a failed rollout, never a NaN in the loss (docs/reliability.md)
    async def run(self, ctx):
        return Result(reward=float("nan"))


class WrongReturn(ChatAgent):
    async def run(self, ctx):
        return 1.0


class SlowRequest(ChatAgent):
    async def run(self, ctx):
        from openai import AsyncOpenAI

        api = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
        await api.chat.completions.create(model=ctx.model_name, messages=ctx.messages)


@pytest.mark.parametrize(
    "agent,status,reason",
    [
        (Raising, RolloutStatus.AGENT_ERROR, "RuntimeError: tool crashed"),
        (Sleeping, RolloutStatus.TIMEOUT, "timeout of 0.3s"),
        (NoReward, RolloutStatus.INVALID_REWARD, "got None"),
        (NaNReward, RolloutStatus.INVALID_REWARD, "must be finite, got nan"),
        (WrongReturn, RolloutStatus.INVALID_REWARD, "must return molt.agents.Result, got float"),
        (SlowRequest, RolloutStatus.TIMEOUT, "timeout"),
    ],
)
async def test_failures_become_statuses(tokenizer, agent, status, reason):
    engine = ScriptedEngine(tokenizer, ["late"], delay=5.0)
    loop = asyncio.get_running_loop()
    start = loop.time()
    traj = await run(ChatAgentRunner(agent, timeout=0.3), engine, tokenizer)
    assert traj.status is status and reason in traj.error and not traj.ok
    assert ("Traceback (most recent call last)" in traj.traceback) == (status is not RolloutStatus.TIMEOUT)
    assert loop.time() - start < 3  # a stuck agent or request does not hold the worker


class Guessing(Env):
    """Wrong twice, then right; asks for a lower temperature after the first turn."""

    def __init__(self):
        self.turn = 0

    async def reset(self, state):
        return {"observation": state["observation"] + " Answer with a number.", "label": state["label"]}

    async def step(self, state):
        self.turn += 1
        done = self.turn == 3
        return Result(
            reward=1.0 if done else -0.25,
            terminated=done,
            observation=f"Wrong, try again ({self.turn})",
            sampling_params={"temperature": 0.5} if self.turn == 1 else None,
            info={"turn": self.turn},
        )


async def test_multi_turn_env_with_chat_observations(tokenizer):
    engine = ScriptedEngine(tokenizer, ["5", "6", "7"])
    traj = await run(StepEnvRunner(Guessing), engine, tokenizer)
    assert traj.ok and traj.reward == pytest.approx(0.5) and traj.info["turn"] == 3.0 and not traj.truncated
    text = tokenizer.decode(traj.segments[-1].token_ids)
    assert "What is 3 + 4? Answer with a number.<|im_end|>" in text
    assert "<|im_start|>user\nWrong, try again (1)<|im_end|>" in text  # wrapped by the chat template
    assert [c["params"].temperature for c in engine.calls] == [1.0, 0.5, 0.5]
    # the temperature change seals the first segment; the later turns continue one segment exactly
    assert [s.break_reason for s in traj.segments] == ["start", "sampling_changed"]
    assert (
        engine.calls[2]["prompt_ids"]
        == traj.segments[1].token_ids[: len(engine.calls[2]["prompt_ids"])].tolist()
    )


class Endless(Env):
    async def step(self, state):
        return Result(reward=1.0, terminated=False, observation="again")


@pytest.mark.parametrize("role", ["tool", "raw"])
async def test_observation_roles(tokenizer, role):
    engine = ScriptedEngine(tokenizer, ["x"])
    traj = await run(StepEnvRunner(Endless, max_turns=2, observation_role=role), engine, tokenizer)
    (segment,) = traj.segments
    text = tokenizer.decode(segment.token_ids)
    expected = "x<|im_end|>again" if role == "raw" else "x<|im_end|>\n<|im_start|>tool\nagain<|im_end|>"
    assert expected in text and traj.truncated and traj.reward == 2.0


async def test_turn_limit_and_token_budget(tokenizer):
    engine = ScriptedEngine(tokenizer, ["one two three"])
    traj = await run(StepEnvRunner(Endless, max_turns=3), engine, tokenizer)
    assert traj.truncated and len(engine.calls) == 3 and traj.reward == 3.0
    engine = ScriptedEngine(tokenizer, ["one two three"])
    traj = await run(StepEnvRunner(Endless, max_turns=10, max_episode_tokens=7), engine, tokenizer)
    reply = len(tokenizer.encode("one two three", add_special_tokens=False)) + 1
    expected, left = [], 7
    while left > 0:  # each turn may use what the episode has left (and at most max_tokens=8)
        expected.append(min(8, left))
        left -= min(reply, expected[-1])
    assert [c["params"].max_tokens for c in engine.calls] == expected
    assert traj.truncated and sum(s.num_actions for s in traj.segments) == 7


class Reseeding(Env):
    """Four turns; the second step asks for a seed of its own."""

    def __init__(self):
        self.turn = 0

    async def step(self, state):
        self.turn += 1
        return Result(
            reward=0.0,
            terminated=self.turn == 4,
            observation="again",
            sampling_params={"seed": 123} if self.turn == 2 else None,
        )


async def test_env_turns_sample_with_their_own_seeds(tokenizer):
    """Each turn of a seeded episode gets its own seed (turn 2 does not replay turn 1's draws), the same ones on a
    rerun; a seed the Env sets is used as it is."""
    seeds = []
    for _ in range(2):
        engine = ScriptedEngine(tokenizer, ["x"])
        assert (
            await run(
                StepEnvRunner(Reseeding), engine, tokenizer, params=SamplingParams(max_tokens=8, seed=7)
            )
        ).ok
        seeds.append([c["params"].seed for c in engine.calls])
    first, rerun = seeds
    assert first == rerun and first[2:] == [123, 123]
    assert first[:2] == [sub_seed(7, 0), sub_seed(7, 1)] and first[0] != first[1]
