"""Incremental streaming: deltas leave while the engine samples, and assemble to the recorded reply."""

import asyncio

import pytest
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from molt.testing.scripted import ScriptedEngine, live_capture_server

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


class HoldingEngine(ScriptedEngine):
    """Streams the first half of its reply, then holds the rest until `hold` is set; counts what it streamed."""

    def __init__(self, tokenizer, replies):
        super().__init__(tokenizer, replies, token_delay=0.001, hold=asyncio.Event())
        self.streamed = 0

    async def generate(self, prompt_ids, params, session_id=None, request_id=None, *, on_tokens=None):
        def count(ids):
            self.streamed += len(ids)
            on_tokens(ids)

        return await super().generate(
            prompt_ids, params, session_id, request_id, on_tokens=count if on_tokens is not None else None
        )


async def _openai_stream(session, engine=None, **kwargs):
    """Stream a reply; with a holding engine, release its second half at the first delta received."""
    api = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key)
    pieces = []
    stream = await api.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "go"}], stream=True, **kwargs
    )
    calls = {}
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:  # with a holding engine: (tokens it had streamed then, text)
                pieces.append((engine.streamed if engine else 0, choice.delta.content))
                if engine is not None:
                    engine.hold.set()
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
    return pieces, calls


async def test_openai_deltas_arrive_while_generating(tokenizer):
    """The engine holds the second half of the reply until the client has a delta: without streaming the
    request would never finish (the wait_for fails the test)."""
    reply = "one two three four five six seven eight nine ten eleven twelve"
    engine = HoldingEngine(tokenizer, [reply])
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        pieces, _ = await asyncio.wait_for(_openai_stream(session, engine), 60)
        (segment,) = await session.close()
    ids = tokenizer.encode(reply, add_special_tokens=False)
    assert 0 < pieces[0][0] <= (len(ids) + 1) // 2  # the first delta left while the engine held the rest
    assert "".join(p for _, p in pieces) == reply
    assert segment.num_actions == len(ids) + 1  # EOS included, recorded once


@pytest.mark.parametrize(
    "reply, kwargs, content, call",
    [
        ("Hello world. STOP and more", {"stop": ["STOP"]}, "Hello world. ", None),
        ("Sure, the words: ab ST ab STOP x", {"stop": ["STOP"]}, "Sure, the words: ab ST ab ", None),
        (
            'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>',
            {"tools": TOOLS},
            "Let me compute.",
            ("calculator", '{"expression": "1+2"}'),
        ),
        ("  spaced , reply", {}, "  spaced , reply", None),
    ],
)
async def test_openai_streamed_reply_equals_the_recorded_one(tokenizer, reply, kwargs, content, call):
    engine = ScriptedEngine(tokenizer, [reply], token_delay=0.002)
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        pieces, calls = await _openai_stream(session, **kwargs)
        api = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key)
        plain = await api.chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "again"}], **kwargs
        )
        assert session.stats.get("stream_mismatch", 0) == 0
    streamed = "".join(p for _, p in pieces)
    assert streamed == content == (plain.choices[0].message.content or "")
    assert "<tool_call>" not in streamed and "STOP" not in streamed
    assert [(c["name"], c["arguments"]) for c in calls.values()] == ([call] if call else [])


async def test_anthropic_text_block_streams_then_tool_use(tokenizer):
    reply = (
        'I will use the calculator for this one.\n<tool_call>\n{"name": "calculator", "arguments": '
        '{"expression": "12 * 7"}}\n</tool_call>'
    )
    engine = HoldingEngine(tokenizer, [reply])
    tools = [{"name": "calculator", "input_schema": {"type": "object", "properties": {}}}]
    first = []

    async def stream_it():  # the engine holds the reply's second half until the client has text
        async with api.messages.stream(
            model="scripted", max_tokens=200, tools=tools, messages=[{"role": "user", "content": "12 * 7?"}]
        ) as stream:
            async for event in stream:
                if event.type == "text" and not first:
                    first.append(engine.streamed)
                    engine.hold.set()
            return await stream.get_final_message()

    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        api = AsyncAnthropic(base_url=session.session_url, api_key=session.api_key)
        message = await asyncio.wait_for(stream_it(), 60)
    n = len(tokenizer.encode(reply, add_special_tokens=False)) + 1  # + EOS
    assert 0 < first[0] <= n // 2  # text left while the engine held the rest
    text, use = message.content
    assert text.text == "I will use the calculator for this one."
    assert (use.name, use.input, message.stop_reason) == ("calculator", {"expression": "12 * 7"}, "tool_use")
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 10


async def test_a_client_error_is_answered_before_the_stream_starts(tokenizer):
    import openai

    engine = ScriptedEngine(tokenizer, ["x"], max_model_len=64)
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        api = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="context window"):
            await api.chat.completions.create(
                model="scripted", stream=True, messages=[{"role": "user", "content": "word " * 200}]
            )


async def test_streamed_logprobs_assemble_in_the_sdk(tokenizer):
    engine = ScriptedEngine(tokenizer, ["a few words here"], token_delay=0.002)
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        api = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key)
        async with api.chat.completions.stream(
            model="scripted", messages=[{"role": "user", "content": "go"}], logprobs=True, top_logprobs=1
        ) as stream:
            final = await stream.get_final_completion()
    entries = final.choices[0].logprobs.content
    n = len(tokenizer.encode("a few words here", add_special_tokens=False)) + 1  # + EOS
    assert [round(e.logprob, 6) for e in entries] == [round(-0.01 * (i + 1), 6) for i in range(n)]
    assert final.choices[0].message.content == "a few words here"


@pytest.mark.parametrize(
    "text", ["plain words, then more words", "naïve café 🙂 emoji ☃ split across byte tokens"]
)
def test_incremental_decode_equals_decoding_everything(tokenizer, text):
    """`LiveReply._extend` decodes a window per batch of tokens; fed one token at a time it never shows an
    unfinished character and ends equal to decoding all the tokens at once."""
    from types import SimpleNamespace

    from molt.capture.render import ChatRenderer
    from molt.capture.streaming import LiveReply

    decode = tokenizer.decode
    reply = SimpleNamespace(session=SimpleNamespace(renderer=ChatRenderer(tokenizer)))
    ids = tokenizer.encode(text, add_special_tokens=False)
    out, prev, read = "", 0, 0
    for k in range(1, len(ids) + 1):
        out, prev, read = LiveReply._extend(reply, out, ids[:k], prev, read)
        assert "\ufffd" not in out and decode(ids[:k], skip_special_tokens=True).startswith(out)
    assert out == decode(ids, skip_special_tokens=True) == text
