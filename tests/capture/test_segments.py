"""Segment transitions and retries through a live server (scripted engine: exact, instant replies)."""

import asyncio

import numpy as np
from openai import AsyncOpenAI

from molt.agents import ChatAgent, ChatAgentRunner, Result
from molt.testing.scripted import ScriptedEngine, live_capture_server
from molt.types import SamplingParams

USER = {"role": "user", "content": "What is 3 + 4?"}


def client(session, **kwargs):
    return AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, **kwargs)


def turns(segment):
    """Number of separate runs of action tokens (sampled turns) in a segment."""
    mask = segment.action_mask
    return sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))


async def ask(api, messages, **kwargs):
    reply = await api.chat.completions.create(model="scripted", messages=messages, **kwargs)
    return reply.choices[0].message.model_dump(exclude_none=True)


class CompactingAgent(ChatAgent):
    """Two turns, then replaces the history with a summary and goes on (what coding agents do)."""

    async def run(self, ctx):
        api = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
        messages = list(ctx.messages)
        for question in ("And 5 + 5?", "And 6 + 6?"):
            messages += [await ask(api, messages), {"role": "user", "content": question}]
        summary = [
            {"role": "system", "content": "Summary of the conversation so far: three sums."},
            {"role": "user", "content": "Go on."},
        ]
        last = await ask(api, summary)
        await ask(api, summary + [last, {"role": "user", "content": "Done?"}])
        return Result(reward=1.0)


async def test_compaction_two_segments_one_reward(tokenizer):
    engine = ScriptedEngine(tokenizer, ["7", "10", "12", "ok"])
    async with live_capture_server(engine, tokenizer) as server:
        traj = await ChatAgentRunner(CompactingAgent).run(
            {"messages": [USER], "label": "7"}, sessions=server, rollout_id="roll-1", group_id="g"
        )
    assert traj.ok and traj.reward == 1.0 and traj.rollout_id == "roll-1"
    assert [s.break_reason for s in traj.segments] == ["start", "compaction"]
    first, second = traj.segments
    actions = [len(tokenizer.encode(t, add_special_tokens=False)) + 1 for t in engine.replies]  # reply + EOS
    assert first.num_actions == sum(actions[:2]) and second.num_actions == sum(actions[2:])
    assert "Summary of the conversation" in tokenizer.decode(second.token_ids)
    assert engine.calls[3]["prompt_ids"] == second.token_ids[: len(engine.calls[3]["prompt_ids"])].tolist()


async def test_think_stripping_is_a_template_rewrite(think_tokenizer):
    engine = ScriptedEngine(think_tokenizer, ["<think>3 plus 4</think>Seven.", "Eight."])
    async with live_capture_server(engine, think_tokenizer) as server:
        session = await server.open_session()
        api = client(session)
        reply = await ask(api, [USER])
        assert reply["content"] == "<think>3 plus 4</think>Seven."
        await ask(api, [USER, reply, {"role": "user", "content": "And 4 + 4?"}])
        first, second = await session.close()
    assert (first.break_reason, second.break_reason) == ("start", "template_rewrite")
    assert "<think>" not in think_tokenizer.decode(second.token_ids)  # the template dropped it from history
    assert second.num_actions == len(think_tokenizer.encode("Eight.", add_special_tokens=False)) + 1


async def test_tools_and_temperature_changes_seal_the_segment(tokenizer):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    engine = ScriptedEngine(tokenizer, ["a", "b", "c", "d"])
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session(sampling_params=SamplingParams(temperature=1.0))
        api = client(session)
        messages = [USER]
        for kwargs in (
            {},
            {"tools": tools},
            {"tools": tools, "temperature": 0.5},
            {"tools": tools, "temperature": 0.5},
        ):
            messages += [await ask(api, messages, **kwargs), {"role": "user", "content": "next"}]
        segments = await session.close()
    assert [s.break_reason for s in segments] == ["start", "tools_changed", "sampling_changed"]
    assert [s.temperature for s in segments] == [1.0, 1.0, 0.5] and segments[2].num_actions == 4


async def test_interleaved_sub_agents_get_one_segment_each(tokenizer):
    engine = ScriptedEngine(tokenizer, lambda prompt, params: f"reply {len(prompt)}")
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        api = client(session)
        a, b = [{"role": "user", "content": "task A"}], [{"role": "user", "content": "task B, longer"}]
        for _ in range(2):  # A, B, A, B: each conversation continues its own segment
            a += [await ask(api, a), {"role": "user", "content": "more A"}]
            b += [await ask(api, b), {"role": "user", "content": "more B"}]
        await asyncio.gather(ask(api, a), ask(api, b))  # concurrent requests in one session are serialized
        segments = await session.close()
    assert [s.break_reason for s in segments] == [
        "start",
        "subagent",
    ]  # A went on after B began: B ran beside it
    assert [turns(s) for s in segments] == [3, 3]
    texts = [tokenizer.decode(s.token_ids) for s in segments]
    assert "task A" in texts[0] and "task B" not in texts[0] and "task B" in texts[1]


async def test_retried_request_is_recorded_once(tokenizer):
    """The client gives up before the (slow) reply and the SDK retries the identical body: the retry is
    answered from the cache; the engine ran once and the segment has one turn."""
    engine = ScriptedEngine(tokenizer, ["slow reply", "other"], delay=0.45)  # just past the 0.3 s timeout:
    # the first retry (after ~0.4 s of back-off) then finds the reply cached even on a loaded machine
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        reply = await ask(client(session, timeout=0.3, max_retries=2), [USER])
        (segment,) = await session.close()
    assert reply["content"] == "slow reply" and len(engine.calls) == 1 and session.stats["cache_hits"] == 1
    assert segment.num_actions == len(tokenizer.encode("slow reply", add_special_tokens=False)) + 1


async def test_deliberate_repeat_is_a_new_sample(tokenizer):
    """The same body sent twice as first attempts (x-stainless-retry-count: 0) is two samples, not a retry."""
    engine = ScriptedEngine(tokenizer, ["first", "second"])
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        api = client(session)
        replies = [await ask(api, [USER]), await ask(api, [USER])]
        segments = await session.close()
    assert [r["content"] for r in replies] == ["first", "second"] and len(engine.calls) == 2
    assert [s.break_reason for s in segments] == ["start", "branch"]


async def test_the_engine_gets_each_prompt_as_the_segments_int32_tokens(tokenizer):
    """A turn's prompt reaches the engine as an int32 array (no Python list of the whole history), exactly the
    segment's tokens up to the reply."""
    prompts = []

    class Recording(ScriptedEngine):
        async def generate(self, prompt_ids, params, *args, **kwargs):
            prompts.append(prompt_ids)
            return await super().generate(prompt_ids, params, *args, **kwargs)

    async with live_capture_server(Recording(tokenizer, ["4 is it", "ten"]), tokenizer) as server:
        session = await server.open_session("r", SamplingParams(max_tokens=8))
        api, messages = client(session), [USER]
        for question in ("And 5 + 5?", "Sure?"):
            messages += [await ask(api, messages), {"role": "user", "content": question}]
        await ask(api, messages)
        [segment] = await session.close()
    assert len(prompts) == 3 and all(isinstance(p, np.ndarray) and p.dtype == np.int32 for p in prompts)
    for prompt in prompts:
        assert segment.token_ids[: len(prompt)].tolist() == prompt.tolist()
        assert not segment.action_mask[len(prompt) - 1] and segment.action_mask[len(prompt)]
