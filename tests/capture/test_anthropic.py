"""The Anthropic wire, end to end: the real AsyncAnthropic client against a live server on 127.0.0.1."""

import pytest
from anthropic import AsyncAnthropic

from molt.testing.scripted import RecordingEngine, ScriptedEngine, live_capture_server
from molt.types import SamplingParams

TOOLS = [
    {
        "name": "calculator",
        "description": "Evaluate arithmetic.",
        "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}},
    }
]
CALL_TEXT = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n</tool_call>'


def client(session):
    return AsyncAnthropic(base_url=session.session_url, api_key=session.api_key)


async def test_multi_turn_real_engine(hf_engine, tokenizer):
    engine = RecordingEngine(hf_engine)
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session("a1", SamplingParams(max_tokens=8))
        api = client(session)
        messages = [{"role": "user", "content": "What is 3 + 4?"}]
        first = await api.messages.create(
            model=session.model_name, system="Be brief.", messages=messages, max_tokens=8
        )
        messages += [{"role": "assistant", "content": first.content}, {"role": "user", "content": "Sure?"}]
        second = await api.messages.create(
            model=session.model_name, system="Be brief.", messages=messages, max_tokens=8
        )
        (segment,) = await session.close()
    (_, p1, c1), (_, p2, c2) = engine.records
    assert first.content[0].text == tokenizer.decode(c1.token_ids, skip_special_tokens=True)
    assert first.stop_reason == ("end_turn" if c1.finish_reason.value == "stop" else "max_tokens")
    assert (second.usage.input_tokens, second.usage.output_tokens) == (len(p2), len(c2.token_ids))
    assert (
        segment.token_ids.tolist() == p2 + c2.token_ids
        and p2[: len(p1) + len(c1.token_ids)] == p1 + c1.token_ids
    )
    assert segment.num_actions == len(c1.token_ids) + len(c2.token_ids)


async def test_streaming_real_engine(hf_engine, tokenizer):
    engine = RecordingEngine(hf_engine)
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session("a2", SamplingParams(max_tokens=12))
        async with client(session).messages.stream(
            model=session.model_name, max_tokens=12, messages=[{"role": "user", "content": "Hello"}]
        ) as stream:
            deltas = [text async for text in stream.text_stream]
            message = await stream.get_final_message()
        (segment,) = await session.close()
    ((_, prompt, completion),) = engine.records
    assert (
        "".join(deltas)
        == message.content[0].text
        == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    )
    assert message.usage.output_tokens == len(completion.token_ids) and message.stop_reason in (
        "end_turn",
        "max_tokens",
    )
    assert segment.token_ids.tolist() == prompt + completion.token_ids


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_use_round_trip(tokenizer, stream):
    engine = ScriptedEngine(tokenizer, [CALL_TEXT, "It is 84."])
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        api = client(session)
        messages = [{"role": "user", "content": "What is 12 * 7?"}]
        if stream:
            async with api.messages.stream(
                model="scripted", max_tokens=64, messages=messages, tools=TOOLS
            ) as events:
                first = await events.get_final_message()
        else:
            first = await api.messages.create(model="scripted", max_tokens=64, messages=messages, tools=TOOLS)
        assert first.stop_reason == "tool_use"
        text, use = first.content
        assert text.text == "Let me compute." and (use.name, use.input) == (
            "calculator",
            {"expression": "12 * 7"},
        )
        messages += [
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "84"}]},
        ]
        final = await api.messages.create(model="scripted", max_tokens=64, messages=messages, tools=TOOLS)
        assert final.content[0].text == "It is 84." and final.stop_reason == "end_turn"
        (segment,) = await session.close()
    call_ids = tokenizer.encode(CALL_TEXT, add_special_tokens=False) + [tokenizer.eos_token_id]
    start = len(engine.calls[0]["prompt_ids"])
    assert segment.token_ids[start : start + len(call_ids)].tolist() == call_ids
    assert "<|im_start|>tool\n84<|im_end|>" in tokenizer.decode(segment.token_ids)


async def test_tool_choice_tool_forces_the_named_call(tokenizer):
    opening = '<tool_call>\n{"name": "calculator", "arguments": '
    call = CALL_TEXT[CALL_TEXT.index("<tool_call>") :]
    engine = ScriptedEngine(tokenizer, [call[len(opening) :]])
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        reply = await client(session).messages.create(
            model="scripted",
            max_tokens=64,
            messages=[{"role": "user", "content": "What is 12 * 7?"}],
            tools=TOOLS,
            tool_choice={"type": "tool", "name": "calculator"},
        )
        assert reply.stop_reason == "tool_use"
        (use,) = reply.content
        assert (use.name, use.input) == ("calculator", {"expression": "12 * 7"})
        forced = tokenizer.encode(opening, add_special_tokens=False)
        assert engine.calls[0]["prompt_ids"][-len(forced) :] == forced


async def test_stop_sequence_and_max_tokens(tokenizer):
    engine = ScriptedEngine(tokenizer, ["alpha beta END gamma", "one two three four five"])
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        api = client(session)
        hit = await api.messages.create(
            model="scripted",
            max_tokens=50,
            stop_sequences=["END"],
            messages=[{"role": "user", "content": "go"}],
        )
        assert (hit.content[0].text, hit.stop_reason, hit.stop_sequence) == (
            "alpha beta ",
            "stop_sequence",
            "END",
        )
        cut = await api.messages.create(
            model="scripted", max_tokens=2, messages=[{"role": "user", "content": "go on"}]
        )
        assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
