"""The Anthropic wire as Claude Code and the SDK's helpers use it: system-role messages, cache_control, thinking,
ignored fields, count_tokens, the base URL, beta headers, message threads (the SDK's tool runner), and refusals."""

import anthropic
import httpx
import pytest
from anthropic import AsyncAnthropic
from transformers import AutoTokenizer

from molt.capture.render import ChatRenderer
from molt.testing.scripted import ScriptedEngine, live_capture_server

CALL_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n</tool_call>'
TOOL = {
    "name": "calculator",
    "description": "Evaluate arithmetic.",
    "cache_control": {"type": "ephemeral"},
    "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}},
}
# what Claude Code sends besides the conversation (its request of `claude -p`, trimmed)
CLAUDE_CODE_FIELDS = {
    "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
    "thinking": {"type": "adaptive"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
    "output_config": {"effort": "medium"},
    "metadata": {"user_id": "u"},
    "container": None,
    "mcp_servers": [],
    "max_tokens": 32,
}


def client(session):
    return AsyncAnthropic(base_url=session.session_url, api_key=session.api_key, max_retries=0)


async def test_claude_code_request_is_accepted_and_rendered(tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL_TEXT, "Done."])
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        api = client(session)
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Compute 12 * 7.", "cache_control": {"type": "ephemeral"}}
                ],
            },
            {"role": "system", "content": "Reminder: be brief."},
        ]
        async with api.messages.stream(
            model="claude-sonnet-4-5",
            messages=messages,
            tools=[TOOL],
            extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"},
            extra_body={k: v for k, v in CLAUDE_CODE_FIELDS.items() if k != "max_tokens"},
            max_tokens=32,
        ) as events:
            first = await events.get_final_message()
        use = first.content[-1]
        messages += [
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I should call the tool.", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    *[b.model_dump() for b in first.content],
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "84"}]},
        ]
        final = await api.messages.create(
            model="claude-sonnet-4-5",
            messages=messages,
            tools=[TOOL],
            extra_body={k: v for k, v in CLAUDE_CODE_FIELDS.items() if k != "max_tokens"},
            max_tokens=32,
        )
        assert final.content[0].text == "Done."
        segments = await session.close()
    prompt = tokenizer.decode(engine.calls[0]["prompt_ids"])
    assert prompt.startswith("<|im_start|>system\nYou are Claude Code.")
    assert "<|im_start|>system\nReminder: be brief.<|im_end|>" in prompt
    # this template has no reasoning channel: thinking blocks are dropped, and the history still continues
    assert "I should call the tool" not in tokenizer.decode(engine.calls[1]["prompt_ids"])
    assert [s.break_reason for s in segments] == ["start"]


async def test_thinking_renders_in_a_reasoning_channel(tiny_llama_dir):
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tok.chat_template = tok.chat_template.replace(
        "{{ content }}",
        "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ content }}",
    )
    engine = ScriptedEngine(tok, ["ok"])
    async with live_capture_server(engine, tok) as server:
        session = await server.open_session()
        await client(session).messages.create(
            model="m",
            max_tokens=8,
            thinking={"type": "enabled", "budget_tokens": 8},
            messages=[
                {"role": "user", "content": "Hi"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "s"},
                        {"type": "text", "text": "Hello"},
                    ],
                },
                {"role": "user", "content": "Bye"},
            ],
        )
    assert "<|im_start|>assistant\n<think>hmm</think>Hello<|im_end|>" in tok.decode(
        engine.calls[0]["prompt_ids"]
    )


async def test_count_tokens_base_url_and_error_shapes(tokenizer):
    engine = ScriptedEngine(tokenizer, ["ok"])
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        api = client(session)
        kwargs = {
            "model": "m",
            "system": [{"type": "text", "text": "Be brief."}],
            "tools": [TOOL],
            "messages": [{"role": "user", "content": "What is 3 + 4?"}],
        }
        counted = await api.messages.count_tokens(**kwargs)
        reply = await api.messages.create(max_tokens=8, **kwargs)
        assert counted.input_tokens == reply.usage.input_tokens == len(engine.calls[0]["prompt_ids"])
        async with httpx.AsyncClient() as http:
            for method in ("HEAD", "GET"):
                assert (await http.request(method, session.session_url)).status_code == 200
            bad = await http.post(
                f"{session.session_url}/v1/messages/count_tokens",
                content=b"{",
                headers={"x-api-key": session.api_key},
            )
            missing = await http.post(
                f"{session.session_url}/v1/messages/batches", headers={"x-api-key": session.api_key}
            )
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        assert missing.status_code == 404 and missing.json()["type"] == "error"


async def test_tool_runner_threads_continue_in_one_segment(tokenizer):
    """The SDK's tool runner sends turn 2 as `thread: continue` with only the tool result (no system, no tools):
    the session resolves `previous_message_id`, so the model sees the whole conversation."""
    engine = ScriptedEngine(tokenizer, [CALL_TEXT, "It is 84."])

    @anthropic.beta_async_tool
    async def calculator(expression: str) -> str:
        """Evaluate arithmetic."""
        return str(eval(expression))

    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        statuses = []

        async def record(response):
            statuses.append(response.status_code)

        http = anthropic.DefaultAsyncHttpxClient(event_hooks={"response": [record]})
        api = AsyncAnthropic(
            base_url=session.session_url, api_key=session.api_key, max_retries=0, http_client=http
        )
        runner = api.beta.messages.tool_runner(
            model="m",
            max_tokens=64,
            system="Use the tool.",
            tools=[calculator],
            messages=[{"role": "user", "content": "What is 12 * 7?"}],
        )
        final = await runner.until_done()
        (segment,) = await session.close()
    assert final.content[0].text == "It is 84." and statuses == [200, 200]
    second = tokenizer.decode(engine.calls[1]["prompt_ids"])
    assert "Use the tool." in second and "What is 12 * 7?" in second and '"calculator"' in second
    assert segment.token_ids[: len(engine.calls[1]["prompt_ids"])].tolist() == engine.calls[1]["prompt_ids"]


async def test_unknown_thread_is_replayed_in_full(tokenizer):
    engine = ScriptedEngine(tokenizer, ["ok"])
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        with pytest.raises(anthropic.BadRequestError) as e:
            await client(session).messages.create(
                model="m",
                max_tokens=8,
                messages=[{"role": "user", "content": "x"}],
                extra_body={"thread": {"type": "continue", "previous_message_id": "msg_gone"}},
            )
    assert e.value.body["error"]["details"]["error_code"] == "thread_not_found"


async def test_special_tool_call_markers_still_parse(tiny_llama_dir):
    """A tokenizer that marks `<tool_call>` special: the reply is parsed with the markers kept (and streamed
    without leaking the call as content); the content shown holds no template special token."""
    from tokenizers import AddedToken

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tok.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<tool_call>", "</tool_call>")],
        special_tokens=True,
    )
    engine = ScriptedEngine(tok, ["Sure." + CALL_TEXT], token_delay=0.001)
    async with live_capture_server(engine, ChatRenderer(tok)) as server:
        session = await server.open_session()
        for stream in (False, True):
            kwargs = {
                "model": "m",
                "max_tokens": 64,
                "tools": [TOOL],
                "messages": [{"role": "user", "content": "?"}],
            }
            if stream:
                async with client(session).messages.stream(**kwargs) as events:
                    reply = await events.get_final_message()
            else:
                reply = await client(session).messages.create(**kwargs)
            text, use = reply.content
            assert text.text == "Sure." and (use.name, use.input) == ("calculator", {"expression": "12 * 7"})
