"""The OpenAI Responses wire, end to end: the real AsyncOpenAI client (`responses.create`, `responses.stream`)
against a live capture server on 127.0.0.1."""

import openai
import pytest
from openai import AsyncOpenAI
from test_openai import assert_exact

from molt.testing.scripted import RecordingEngine, ScriptedEngine, live_capture_server
from molt.types import SamplingParams

TOOLS = [
    {
        "type": "function",
        "name": "calculator",
        "description": "Evaluate arithmetic.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    }
]
CALL_TEXT = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n</tool_call>'


def client(session):
    return AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)


async def respond(api, stream, **kwargs):
    if not stream:
        return await api.responses.create(**kwargs)
    async with api.responses.stream(**kwargs) as events:
        seen = [e async for e in events]
        # the SDK assembles a completed response; one cut by max_output_tokens ends with response.incomplete
        final = (
            await events.get_final_response() if seen[-1].type == "response.completed" else seen[-1].response
        )
    assert seen[-1].type == f"response.{final.status}"
    assert "".join(e.delta for e in seen if e.type == "response.output_text.delta") == final.output_text
    return final


@pytest.mark.parametrize("stream", [False, True])
async def test_multi_turn_is_one_exact_segment(hf_engine, tokenizer, stream):
    """Codex's way (store false, the full input each turn): one segment holding every engine call verbatim."""
    engine = RecordingEngine(hf_engine)
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session("r1", SamplingParams(max_tokens=8, temperature=0.8))
        api = client(session)
        items = [{"role": "user", "content": "What is 3 + 4?"}]
        first = await respond(
            api,
            stream,
            model="m",
            instructions="Be brief.",
            input=items,
            store=False,
            max_output_tokens=8,
            reasoning={"effort": "low"},
            include=[],
            prompt_cache_key="k",
            parallel_tool_calls=False,
            temperature=0.8,
        )
        items += [o.model_dump() for o in first.output] + [
            {"role": "user", "content": [{"type": "input_text", "text": "Sure?"}]}
        ]
        second = await respond(
            api,
            stream,
            model="m",
            instructions="Be brief.",
            input=items,
            store=False,
            max_output_tokens=8,
            temperature=0.8,
        )
        (segment,) = await session.close()
    records = engine.of_session(session.session_id)
    assert_exact(segment, records)
    (p1, c1), (p2, c2) = records
    assert first.output_text == tokenizer.decode(c1.token_ids, skip_special_tokens=True)
    assert (second.usage.input_tokens, second.usage.output_tokens) == (len(p2), len(c2.token_ids))
    assert second.status in ("completed", "incomplete") and second.id.startswith("resp_")
    assert (
        p1
        == tokenizer.apply_chat_template(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 + 4?"}],
            add_generation_prompt=True,
            tokenize=True,
        )["input_ids"]
    )


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("stateful", [False, True])
async def test_function_call_loop(tokenizer, stream, stateful):
    """A tool loop: the call comes back as a function_call item; its output is sent back with the whole input
    (store false) or with `previous_response_id` only; either way one segment."""
    engine = ScriptedEngine(tokenizer, [CALL_TEXT, "It is 84."])
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        api = client(session)
        items = [{"role": "user", "content": "What is 12 * 7?"}]
        first = await respond(api, stream, model="m", input=items, tools=TOOLS, tool_choice="auto")
        text, call = first.output
        assert text.content[0].text == "Let me compute." and call.type == "function_call"
        assert (call.name, call.arguments) == ("calculator", '{"expression": "12 * 7"}')
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "84"}
        if stateful:
            final = await respond(
                api, stream, model="m", input=[result], tools=TOOLS, previous_response_id=first.id
            )
        else:
            final = await respond(
                api,
                stream,
                model="m",
                tools=TOOLS,
                input=items + [o.model_dump() for o in first.output] + [result],
            )
        assert final.output_text == "It is 84." and final.status == "completed"
        (segment,) = await session.close()
    assert segment.break_reason == "start"
    assert "<|im_start|>tool\n84<|im_end|>" in tokenizer.decode(segment.token_ids)
    assert segment.num_actions == len(tokenizer.encode(CALL_TEXT + "It is 84.", add_special_tokens=False)) + 2


@pytest.mark.parametrize("stream", [False, True])
async def test_a_reply_cut_by_max_output_tokens_has_an_incomplete_message(tokenizer, stream):
    """As the OpenAI API does: the response and its message item say `incomplete`, with the reason."""
    engine = ScriptedEngine(tokenizer, ["One two three four five six seven eight nine ten."])
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        reply = await respond(client(session), stream, model="m", input="Count.", max_output_tokens=3)
    (message,) = reply.output
    assert (reply.status, message.status, reply.incomplete_details.reason) == (
        "incomplete",
        "incomplete",
        "max_output_tokens",
    )
    assert reply.usage.output_tokens == 3


async def test_rewritten_history_breaks_the_segment(tokenizer):
    engine = ScriptedEngine(tokenizer, ["Seven.", "Yes."])
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        api = client(session)
        first = await api.responses.create(model="m", input="What is 3 + 4?")
        await api.responses.create(
            model="m",
            input=[
                {"role": "user", "content": "What is 3 + 5?"},
                *[o.model_dump() for o in first.output],
                {"role": "user", "content": "Sure?"},
            ],
        )
        await api.responses.create(model="m", input="Hi", tools=TOOLS)
        segments = await session.close()
    assert [s.break_reason for s in segments] == ["start", "compaction", "tools_changed"]


async def test_missing_max_output_tokens_is_the_rest_of_the_window(tokenizer):
    engine = ScriptedEngine(tokenizer, ["ok"])
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        await client(session).responses.create(model="m", input="Hi")
        await client(session).chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}])
    assert [c["params"].max_tokens for c in engine.calls] == [None, None]


async def test_refusals_are_400s_naming_the_field(tokenizer):
    engine = ScriptedEngine(tokenizer, ["ok"])
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        api = client(session)
        bad = {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}
        with pytest.raises(openai.BadRequestError, match="text.format: json_schema: .*Invalid type") as e:
            await api.responses.create(model="m", input="Hi", text={"format": bad})
        assert e.value.body["param"] == "text.format"
        with pytest.raises(openai.BadRequestError, match="previous_response_id"):
            await api.responses.create(model="m", input="Hi", previous_response_id="resp_unknown")
        await api.responses.create(model="m", input="Hi", text={"format": {"type": "text"}})
    assert len(engine.calls) == 1


CODEX_TOOLS = {
    "type": "additional_tools",
    "role": "developer",
    "tools": [  # as Codex sends its default model tools
        {
            "type": "namespace",
            "name": "functions",
            "description": "",
            "tools": [
                {"type": "custom", "name": "exec", "description": "Run a script."},
                {"type": "function", "name": "wait", "parameters": {"type": "object", "properties": {}}},
            ],
        }
    ],
}
EXEC_CALL = '<tool_call>\n{"name": "exec", "arguments": {"input": "print(6 * 7)"}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
async def test_custom_tools_in_an_additional_tools_item(tokenizer, stream):
    """A free-text custom tool, offered in an `additional_tools` input item (Codex's default model): the model sees
    it as a function of one string; its call comes back as a `custom_tool_call` item and its output continues the
    segment."""
    engine = ScriptedEngine(tokenizer, [EXEC_CALL, "It is 42."])
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        api = client(session)
        items = [CODEX_TOOLS, {"role": "user", "content": "What is 6 * 7?"}]
        first = await respond(api, stream, model="m", input=items)
        (call,) = first.output
        assert (call.type, call.name, call.input, call.namespace) == (
            "custom_tool_call",
            "exec",
            "print(6 * 7)",
            "functions",
        )
        result = {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "42"}
        final = await respond(
            api, stream, model="m", input=items + [call.model_dump(exclude_none=True), result]
        )
        assert final.output_text == "It is 42."
        (segment,) = await session.close()
    prompt = tokenizer.decode(engine.calls[0]["prompt_ids"])
    assert '"name": "exec"' in prompt and '"input"' in prompt and '"name": "wait"' in prompt
    assert "<|im_start|>tool\n42<|im_end|>" in tokenizer.decode(segment.token_ids)


async def test_custom_tools_the_reply_grammar_cannot_hold_are_refused(tokenizer):
    """A recursive Lark grammar cannot become the one terminal a call's raw input is (tools.call_grammar); a
    format of another type is unknown: 400s naming the field, nothing generated."""
    engine = ScriptedEngine(tokenizer, ["ok"])
    recursive = {"type": "grammar", "syntax": "lark", "definition": 'start: "(" start ")" | "x"'}
    async with live_capture_server(engine, tokenizer) as server:
        api = client(await server.open_session())
        with pytest.raises(
            openai.BadRequestError, match=r"tools\[exec\]: .*circular reference .*T0R_START"
        ) as e:
            await api.responses.create(
                model="m", input="Hi", tools=[{"type": "custom", "name": "exec", "format": recursive}]
            )
        with pytest.raises(openai.BadRequestError, match="'exec' has a format of type 'xml'") as e2:
            await api.responses.create(
                model="m", input="Hi", tools=[{"type": "custom", "name": "exec", "format": {"type": "xml"}}]
            )
    assert e2.value.body["param"] == "tools" and e.value.status_code == 400 and not engine.calls
