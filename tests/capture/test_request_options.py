"""Request options on both wires, with the real SDKs against a live server: what reaches the engine
(`max_completion_tokens`, `top_k`, `min_tokens`, the `developer` role), `tool_choice` "none" (tool-call text
stays text) and Anthropic's "any" (a forced call), the retry cache's eviction, and closing a session aborting
its engine request."""

import asyncio

from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from molt.testing.scripted import ScriptedEngine, live_capture_server

CALL_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n</tool_call>'
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
ANTHROPIC_TOOLS = [
    {
        "name": "calculator",
        "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}},
    }
]
USER = [{"role": "user", "content": "What is 12 * 7?"}]


def _openai(session, **kwargs):
    return AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, **kwargs)


def _anthropic(session):
    return AsyncAnthropic(base_url=session.session_url, api_key=session.api_key)


async def test_openai_options_reach_the_engine(tokenizer):
    engine = ScriptedEngine(tokenizer, ["fine"])
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        await _openai(session).chat.completions.create(
            model="scripted",
            max_completion_tokens=7,
            max_tokens=99,
            extra_body={"top_k": 5, "min_tokens": 2},
            messages=[{"role": "developer", "content": "Be brief."}, *USER],
        )
    (call,) = engine.calls
    assert (call["params"].max_tokens, call["params"].top_k, call["params"].min_tokens) == (7, 5, 2)
    system = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *USER], add_generation_prompt=True, tokenize=False
    )
    assert tokenizer.decode(call["prompt_ids"]) == system  # developer is rendered as the system turn


async def test_anthropic_top_k_reaches_the_engine(tokenizer):
    engine = ScriptedEngine(tokenizer, ["fine"])
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        await _anthropic(session).messages.create(
            model="scripted", max_tokens=9, extra_body={"top_k": 3}, messages=USER
        )
    (call,) = engine.calls
    assert (call["params"].max_tokens, call["params"].top_k) == (9, 3)


async def test_tool_choice_none_keeps_call_text_as_text_on_both_wires(tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL_TEXT])
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        reply = await _openai(session).chat.completions.create(
            model="scripted", messages=USER, tools=OPENAI_TOOLS, tool_choice="none"
        )
        message = await _anthropic(session).messages.create(
            model="scripted",
            max_tokens=64,
            messages=USER,
            tools=ANTHROPIC_TOOLS,
            tool_choice={"type": "none"},
        )
    choice = reply.choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (
        CALL_TEXT,
        None,
        "stop",
    )
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == CALL_TEXT
    assert message.stop_reason == "end_turn"


async def test_anthropic_tool_choice_any_forces_a_call(tokenizer):
    opening = "<tool_call>\n"
    engine = ScriptedEngine(tokenizer, [CALL_TEXT[len(opening) :]])
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        reply = await _anthropic(session).messages.create(
            model="scripted", max_tokens=64, messages=USER, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"}
        )
    (use,) = reply.content
    assert (use.name, use.input, reply.stop_reason) == ("calculator", {"expression": "12 * 7"}, "tool_use")
    forced = tokenizer.encode(opening, add_special_tokens=False)
    assert engine.calls[0]["prompt_ids"][-len(forced) :] == forced  # the model continued from the opening


async def test_retry_cache_evicts_the_oldest_answer(tokenizer):
    """SDK retries (x-stainless-retry-count > 0) are answered from a bounded cache: with room for two answers,
    a retry of the first of three questions is generated again, a retry of the last is not."""
    engine = ScriptedEngine(tokenizer, ["a", "b", "c", "d"])
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        session._cache_size = 2
        api = _openai(session)
        questions = [[{"role": "user", "content": q}] for q in ("one?", "two?", "three?")]
        for q in questions:
            await api.chat.completions.create(model="scripted", messages=q)
        retry = {"x-stainless-retry-count": "1"}
        last = await api.chat.completions.create(model="scripted", messages=questions[2], extra_headers=retry)
        first = await api.chat.completions.create(
            model="scripted", messages=questions[0], extra_headers=retry
        )
        assert session.stats["cache_hits"] == 1
    assert last.choices[0].message.content == "c" and first.choices[0].message.content == "d"
    assert len(engine.calls) == 4


async def test_closing_a_session_aborts_its_engine_request(tokenizer):
    engine = ScriptedEngine(tokenizer, ["late"], delay=600.0)  # ends early only when aborted
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        request = asyncio.create_task(
            _openai(session, max_retries=0).chat.completions.create(model="scripted", messages=USER)
        )
        while not engine.calls:  # the request has reached the engine
            await asyncio.sleep(0.01)
        await session.close()
        await asyncio.wait_for(asyncio.gather(request, return_exceptions=True), 60)
    assert len(engine._aborted) == 1 and not engine._waiting
