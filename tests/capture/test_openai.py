"""The OpenAI wire, end to end: the real AsyncOpenAI client against a live server on 127.0.0.1."""

import numpy as np
import pytest
from openai import AsyncOpenAI

from molt.testing.scripted import RecordingEngine, ScriptedEngine, live_capture_server
from molt.types import SamplingParams

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate arithmetic.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
CALL_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n</tool_call>'


def client(session, **kwargs):
    return AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, **kwargs)


def assert_exact(segment, records):
    """Each engine call of the session is in the segment verbatim: its prompt as a prefix, its completion as
    action tokens with the engine's log-probabilities and versions; nothing else is an action."""
    assert len(segment.action_mask) == len(segment.token_ids)
    ids, mask = segment.token_ids.tolist(), segment.action_mask.tolist()
    for prompt, completion in records:
        n, k = len(prompt), len(completion.token_ids)
        assert ids[:n] == prompt
        assert ids[n : n + k] == completion.token_ids
        assert mask[n : n + k] == [1] * k
    prompt, last = records[-1]
    assert ids == prompt + last.token_ids
    assert segment.num_actions == sum(len(c.token_ids) for _, c in records)
    # log-probs and versions: one per action token, so the completions' own, one after the other
    np.testing.assert_array_equal(
        segment.behavior_logprobs, np.float32([x for _, c in records for x in c.logprobs])
    )
    np.testing.assert_array_equal(segment.versions, [v for _, c in records for v in c.versions])


async def test_single_turn_real_engine(hf_engine, tokenizer):
    engine = RecordingEngine(hf_engine)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 + 4?"}]
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session("r0", SamplingParams(max_tokens=12))
        reply = await client(session).chat.completions.create(
            model=session.model_name, messages=messages, logprobs=True, top_logprobs=2, seed=3
        )
        (segment,) = await session.close()
    ((session_id, prompt, completion),) = engine.records
    assert session_id == session.session_id and segment.break_reason == "start"
    assert (
        prompt
        == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    )
    assert_exact(segment, [(prompt, completion)])
    choice = reply.choices[0]
    assert choice.message.content == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert choice.finish_reason == ("stop" if completion.finish_reason.value == "stop" else "length")
    assert [e.logprob for e in choice.logprobs.content] == pytest.approx(completion.logprobs)
    assert all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (
        len(prompt),
        len(completion.token_ids),
    )


async def test_multi_turn_is_one_exact_segment(hf_engine, tokenizer):
    """Three turns, the last one appending four messages at once (one of them an assistant turn the agent
    wrote itself): one segment holding every engine call verbatim."""
    engine = RecordingEngine(hf_engine)
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session("r1", SamplingParams(max_tokens=10, temperature=0.8))
        api = client(session)
        messages = [{"role": "user", "content": "Count to three."}]
        for appended in (
            [{"role": "user", "content": "And then?"}],
            [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "written by the agent"},
                {"role": "user", "content": "b"},
            ],
        ):
            reply = await api.chat.completions.create(
                model=session.model_name, messages=messages, max_tokens=4 + len(messages)
            )
            messages = messages + [reply.choices[0].message.model_dump(exclude_none=True)] + appended
        await api.chat.completions.create(model=session.model_name, messages=messages)
        segments = await session.close()
    assert [s.break_reason for s in segments] == ["start"]
    assert len(engine.records) == 3
    assert_exact(segments[0], [(p, c) for _, p, c in engine.records])
    # the agent-written assistant turn and the users' turns are context, rendered by the template
    assert "written by the agent" in tokenizer.decode(segments[0].token_ids)


async def test_unfinished_turn_is_closed_by_the_template(tokenizer):
    """A reply cut by max_tokens has no end-of-turn token; the next turn's context supplies it."""
    engine = ScriptedEngine(tokenizer, ["one two three four five six", "ok"])
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        api = client(session)
        messages = [{"role": "user", "content": "hi"}]
        first = await api.chat.completions.create(model="scripted", messages=messages, max_tokens=3)
        assert first.choices[0].finish_reason == "length"
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "go"},
        ]
        await api.chat.completions.create(model="scripted", messages=messages)
        (segment,) = await session.close()
    start, end = len(engine.calls[0]["prompt_ids"]) + 3, len(engine.calls[1]["prompt_ids"])
    assert tokenizer.decode(segment.token_ids[start:end]) == (
        "<|im_end|>\n<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n"
    )
    assert segment.action_mask[start - 3 : end].tolist() == [1, 1, 1] + [0] * (end - start)


async def test_streaming_with_usage(hf_engine, tokenizer):
    engine = RecordingEngine(hf_engine)
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session("r2", SamplingParams(max_tokens=16))
        stream = await client(session).chat.completions.create(
            model=session.model_name,
            messages=[{"role": "user", "content": "Tell me a story."}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        (segment,) = await session.close()
    ((_, prompt, completion),) = engine.records
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(completion.token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert_exact(segment, [(prompt, completion)])


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_call_round_trip(tokenizer, stream):
    engine = ScriptedEngine(tokenizer, [CALL_TEXT, "The answer is 84."])
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        api = client(session)
        messages = [{"role": "user", "content": "What is 12 * 7?"}]
        if stream:
            async with api.chat.completions.stream(
                model="scripted", messages=messages, tools=TOOLS
            ) as events:
                first = await events.get_final_completion()
        else:
            first = await api.chat.completions.create(model="scripted", messages=messages, tools=TOOLS)
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls" and not message.content
        (call,) = message.tool_calls
        assert call.function.name == "calculator" and call.function.arguments == '{"expression": "12 * 7"}'
        messages += [message, {"role": "tool", "tool_call_id": call.id, "content": "84"}]
        final = await api.chat.completions.create(model="scripted", messages=messages, tools=TOOLS)
        assert final.choices[0].message.content == "The answer is 84."
        (segment,) = await session.close()
    call_ids = tokenizer.encode(CALL_TEXT, add_special_tokens=False) + [tokenizer.eos_token_id]
    start = len(engine.calls[0]["prompt_ids"])
    assert (
        segment.token_ids[start : start + len(call_ids)].tolist() == call_ids
    )  # sampled tokens kept, not re-rendered
    assert "<|im_start|>tool\n84<|im_end|>" in tokenizer.decode(segment.token_ids)
    assert engine.calls[1]["prompt_ids"] == segment.token_ids[: len(engine.calls[1]["prompt_ids"])].tolist()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "calculator"}}])
async def test_tool_choice_forces_a_call_through_the_opening(tokenizer, choice):
    """The forced opening is context (mask 0) before the model's continuation; the parsed call joins both; the
    next turn continues the same segment."""
    named = isinstance(choice, dict)
    opening = '<tool_call>\n{"name": "calculator", "arguments": ' if named else "<tool_call>\n"
    rest = CALL_TEXT[len(opening) :]
    engine = ScriptedEngine(tokenizer, [rest, "It is 84."])
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        api = client(session)
        messages = [{"role": "user", "content": "What is 12 * 7?"}]
        first = await api.chat.completions.create(
            model="scripted", messages=messages, tools=TOOLS, tool_choice=choice
        )
        (call,) = first.choices[0].message.tool_calls
        assert first.choices[0].finish_reason == "tool_calls"
        assert (call.function.name, call.function.arguments) == ("calculator", '{"expression": "12 * 7"}')
        messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "84"}]
        await api.chat.completions.create(model="scripted", messages=messages, tools=TOOLS)
        (segment,) = await session.close()
    forced = tokenizer.encode(opening, add_special_tokens=False)
    prompt = engine.calls[0]["prompt_ids"]
    assert prompt[-len(forced) :] == forced  # the model continued from the opening
    n, k = len(prompt), len(tokenizer.encode(rest, add_special_tokens=False)) + 1
    ids, mask = segment.token_ids.tolist(), segment.action_mask.tolist()
    assert ids[:n] == prompt and mask[n - len(forced) : n] == [0] * len(forced)
    assert mask[n : n + k] == [1] * k  # only the continuation is an action
    assert engine.calls[1]["prompt_ids"] == ids[: len(engine.calls[1]["prompt_ids"])]


@pytest.mark.parametrize(
    "choice, match",
    [
        ({"type": "function", "function": {"name": "search"}}, "not among the tools"),
        ("required", "needs at least one tool"),
        ({"type": "custom"}, "tool_choice must be"),
    ],
)
async def test_tool_choice_that_cannot_be_honoured_is_a_400(tokenizer, choice, match):
    import openai

    engine = ScriptedEngine(tokenizer, ["x"])
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        tools = None if choice == "required" else TOOLS
        with pytest.raises(openai.BadRequestError, match=match):
            await client(session, max_retries=0).chat.completions.create(
                model="scripted",
                messages=[{"role": "user", "content": "x"}],
                tool_choice=choice,
                **({"tools": tools} if tools else {}),
            )
    assert engine.calls == []


async def test_malformed_tool_json_is_text(tokenizer):
    bad = '<tool_call>{"name": "calculator", "arguments": {oops</tool_call>'
    engine = ScriptedEngine(tokenizer, [bad])
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        reply = await client(session).chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "x"}], tools=TOOLS
        )
        assert reply.choices[0].message.content == bad and reply.choices[0].message.tool_calls is None
        assert reply.choices[0].finish_reason == "stop" and session.stats["malformed_tool_calls"] == 1


async def test_stop_strings_n_and_seed(tokenizer):
    engine = ScriptedEngine(tokenizer, ["Hello world. STOP and more", "second sample"])
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        api = client(session)
        messages = [{"role": "user", "content": "hi"}]
        reply = await api.chat.completions.create(
            model="scripted", messages=messages, stop=["STOP", "zzz"], n=2, seed=5
        )
        first, second = reply.choices
        assert (first.message.content, first.finish_reason) == ("Hello world. ", "stop")
        assert second.message.content == "second sample" and reply.usage.completion_tokens > 0
        assert [c["params"].seed for c in engine.calls] == [5, 6]
        # continue the conversation from the second choice: it extends that choice's branch segment
        messages += [second.message, {"role": "user", "content": "more"}]
        await api.chat.completions.create(model="scripted", messages=messages)
        main, branch = await session.close()
    kept = main.token_ids[len(engine.calls[0]["prompt_ids"]) :]
    assert tokenizer.decode(kept).endswith("STOP") and "more" not in tokenizer.decode(kept)
    assert (main.break_reason, branch.break_reason) == ("start", "branch")
    n_tokens = [
        len(tokenizer.encode(t, add_special_tokens=False)) + 1 for t in ("second sample", engine.replies[0])
    ]
    assert branch.num_actions == sum(
        n_tokens
    )  # its own choice and the continuation; the shared prompt is context
    assert branch.token_ids[: len(engine.calls[2]["prompt_ids"])].tolist() == engine.calls[2]["prompt_ids"]


async def test_models_endpoint(tokenizer):
    async with live_capture_server(ScriptedEngine(tokenizer), tokenizer) as server:
        session = await server.open_session()
        models = await client(session).models.list()
        assert [m.id for m in models.data] == ["scripted"]


@pytest.mark.filterwarnings(
    "ignore:The model 'claude-sonnet-4-5' is deprecated"
)  # the SDK's notice, not ours
async def test_any_model_name_is_served_and_echoed(hf_engine, tokenizer):
    """A black-box agent naming its own model works unchanged (the reference serves any name); the segment is
    still token-exact. Anthropic's SDK on the same session, with its own model name."""
    from anthropic import AsyncAnthropic

    engine = RecordingEngine(hf_engine)
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session("r-any", SamplingParams(max_tokens=8))
        messages = [{"role": "user", "content": "Say hi."}]
        reply = await client(session).chat.completions.create(model="anything", messages=messages)
        assert reply.model == "anything"
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": "Again."})
        answer = await AsyncAnthropic(base_url=session.session_url, api_key=session.api_key).messages.create(
            model="claude-sonnet-4-5", max_tokens=8, messages=messages
        )
        assert answer.model == "claude-sonnet-4-5"
        segments = await session.close()
    assert [s.break_reason for s in segments] == ["start"]
    assert_exact(segments[0], [(p, c) for _, p, c in engine.records])
