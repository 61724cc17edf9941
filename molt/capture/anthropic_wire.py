"""The Anthropic Messages wire: request schema, conversion to a `ChatRequest`, response and SSE event stream.

Supported: `system` (string or text blocks), `messages` with text, `image` (base64 or url sources, for
vision-language models: `molt.capture.render`), `tool_use` and `tool_result` blocks (results may hold images),
`tools` (converted to OpenAI function definitions so the chat template sees one format; `strict` ones, Anthropic's
strict tool use, have their input held to `input_schema` by the reply grammar, `Session._constrain`), `tool_choice`
(`none` disables parsing; `any` and `tool` force a call, see `molt.capture.session`), `max_tokens`, `temperature`, `top_p`,
`top_k`, `stop_sequences`, `stream`. `stop_reason` is `tool_use`, `stop_sequence`, `max_tokens` or
`end_turn`; `usage` counts the real prompt and completion tokens.

Also what Claude Code sends: `system` text blocks and any block's `cache_control` (ignored); `system`-role
messages inside `messages` (kept in place as system messages; leading ones join the `system` prompt, since
templates place a system prompt only first); `thinking` and `redacted_thinking` blocks in assistant turns (a
thinking block's text becomes the turn's `reasoning_content` where the chat template renders one, and is dropped
otherwise; redacted thinking is opaque and always dropped); `thread` (message threads: a `continue` resolves
`previous_message_id` from the session's latest replies, `Session.recall`, taking the thread's system prompt and
tools; an unknown id is a 400 with `error_code: thread_not_found`, on which the SDK replays the whole history);
`POST /v1/messages/count_tokens` (the prompt tokens the request would send the engine now, with the real
template and the segment it would continue); `output_config.format` / `output_format` (structured outputs:
the reply is held to the JSON schema by constrained decoding, `errors.output_schema`). Accepted and ignored:
`thinking` (the model thinks as its template lets it; replies come back as text), `context_management`, `output_config.effort`, `metadata`, `container`,
`mcp_servers`, `service_tier`, `anthropic-beta` headers, and any other field a model server may ignore.

Decisions: `max_tokens` may be left out or null (the session default applies), since agents pass
`ctx.sampling_params.max_tokens`, which may be None; temperature up to 2 is accepted (training may sample
hotter than Anthropic allows). In a user turn, tool results become `tool` messages, followed by the turn's
text blocks as one user message. Block types other than those above (documents, server tool results) are 400s.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from molt.capture.errors import WireError, output_schema
from molt.capture.openai_wire import tool_choice
from molt.capture.render import canonical_tools, content_parts, merge_leading_system
from molt.capture.session import ChatRequest, Choice, Generation, Session
from molt.capture.streaming import LiveReply
from molt.capture.tools import tool_call


class TextBlock(BaseModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ImageBlock(BaseModel):
    type: Literal["image"]
    source: dict[str, Any]  # {"type": "base64", "media_type", "data"} or {"type": "url", "url"}


class ThinkingBlock(BaseModel):
    type: Literal["thinking"]
    thinking: str


class RedactedThinkingBlock(BaseModel):
    type: Literal["redacted_thinking"]


class ToolResultBlock(BaseModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock] | None = None
    is_error: bool | None = None


Block = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(BaseModel):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class Tool(BaseModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    # strict tool use: the call's input follows input_schema (constrained decoding)
    strict: bool | None = None


class MessagesRequest(BaseModel):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    tools: list[Tool] | None = None
    tool_choice: dict[str, Any] | None = None
    thread: dict[str, Any] | None = None  # {"type": "create"} | {"type": "continue", "previous_message_id"}
    output_config: dict[str, Any] | None = None  # `format` honoured, `effort` ignored
    output_format: dict[str, Any] | None = None  # the beta's name for output_config.format


SCHEMA = MessagesRequest


def _text(content: str | list[TextBlock] | None) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content or [])


def _content(blocks: str | list[Any] | None, session: Session) -> str | list[dict[str, Any]]:
    """Text and image blocks as canonical content (`molt.capture.render.content_parts`)."""
    if not isinstance(blocks, list):
        return blocks or ""
    return content_parts(
        [
            {"type": "text", "text": b.text}
            if isinstance(b, TextBlock)
            else {"type": "image_url", "image_url": {"url": _url(b.source)}}
            for b in blocks
            if isinstance(b, (TextBlock, ImageBlock))
        ],
        session.renderer.image,
    )


def _url(src: dict[str, Any]) -> str:
    if src.get("type") == "url":
        return str(src.get("url"))
    return f"data:{src.get('media_type')};base64,{src.get('data')}"


def _messages(req: MessagesRequest, session: Session) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system)})
    for m in req.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text = "".join(b.text for b in m.content if isinstance(b, TextBlock))
        if m.role != "user":
            calls = [tool_call(b.id, b.name, b.input) for b in m.content if isinstance(b, ToolUseBlock)]
            thinking = "".join(b.thinking for b in m.content if isinstance(b, ThinkingBlock))
            out.append(
                {
                    "role": m.role,
                    "content": text,
                    **({"tool_calls": calls} if calls else {}),
                    **({"reasoning_content": thinking} if thinking and session.renderer.reasoning else {}),
                }
            )
            continue
        results = [b for b in m.content if isinstance(b, ToolResultBlock)]
        out += [
            {"role": "tool", "content": _content(b.content, session), "tool_call_id": b.tool_use_id}
            for b in results
        ]
        content = _content(m.content, session)
        if content or not results:
            out.append({"role": "user", "content": content})
    return merge_leading_system(out)


def _thread(
    req: MessagesRequest, session: Session
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) a `thread: continue` request continues from: the session's record of the reply it
    names; ([], None) for any other request."""
    if (req.thread or {}).get("type") != "continue":
        return [], None
    found = session.recall(str(req.thread.get("previous_message_id")))
    if found is None:  # the SDK then replays the whole history under a new thread
        raise WireError(
            400,
            f"thread: no message {req.thread.get('previous_message_id')!r} in this session",
            param="thread",
            details={"error_code": "thread_not_found"},
        )
    return found


def to_chat(req: MessagesRequest, data: dict[str, Any], session: Session) -> ChatRequest:
    fmt = (req.output_config or {}).get("format", req.output_format)
    params = session.sampling(
        max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k
    )
    history, thread_tools = _thread(req, session)
    tools = thread_tools
    if req.tools is not None:
        functions = [
            {"name": t.name, "parameters": t.input_schema, "description": t.description or None}
            for t in req.tools
        ]
        tools = canonical_tools([{"type": "function", "function": f} for f in functions])
    choice, name = tool_choice(req.tool_choice)
    return ChatRequest(
        history + _messages(req, session),
        tools,
        params,
        list(req.stop_sequences or []),
        1,
        parse_tools=bool(tools) and choice != "none",
        tool_choice=choice,
        tool_name=name,
        formats={t.name: {"schema": t.input_schema} for t in req.tools or [] if t.strict},
        output=output_schema(fmt, "output_config.format"),
    )


def count_tokens(req: MessagesRequest, data: dict[str, Any], session: Session) -> dict[str, Any]:
    """POST /v1/messages/count_tokens: the prompt tokens this request would send the engine now."""
    chat = to_chat(req, data, session)
    return {
        "input_tokens": len(
            session.tracker.plan(chat.messages, chat.tools, chat.params.temperature).prompt_ids
        )
    }


def _stop_reason(ch: Choice) -> str:
    return {"tool_calls": "tool_use", "length": "max_tokens"}.get(
        ch.finish_reason, "stop_sequence" if ch.stop_sequence is not None else "end_turn"
    )


def _blocks(ch: Choice) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if ch.content or not ch.tool_calls:
        blocks.append({"type": "text", "text": ch.content})
    for c in ch.tool_calls:
        args = c["function"]["arguments"]
        blocks.append(
            {
                "type": "tool_use",
                "id": c["id"],
                "name": c["function"]["name"],
                "input": args if isinstance(args, dict) else {},
            }
        )
    return blocks


def response_body(gen: Generation, req: MessagesRequest, session: Session | None = None) -> dict[str, Any]:
    ch = gen.choices[0]
    return {
        "id": f"msg_{gen.id}",
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": _blocks(ch),
        "stop_reason": _stop_reason(ch),
        "stop_sequence": ch.stop_sequence,
        "usage": {"input_tokens": len(gen.prompt_ids), "output_tokens": len(ch.action_ids)},
    }


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


def stream(live: LiveReply, req: MessagesRequest, session: Session | None = None) -> AsyncIterator[bytes]:
    """message_start; the text block's deltas while the engine samples (streaming.py), then the rest of it;
    tool_use blocks; message_delta (stop reason, usage); message_stop. A failure after the first byte ends the
    stream with an error event."""
    start = {
        "id": f"msg_{live.id}",
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": live.prompt_tokens, "output_tokens": 0},
    }

    def end(gen: Generation, text: Iterator[bytes]) -> Iterator[bytes]:
        body = response_body(gen, req)
        shift = 0
        if live.sent and body["content"][0]["type"] != "text":  # a stream mismatch: close the text sent
            yield _event("content_block_stop", {"index": 0})
            shift = 1
        for i, block in enumerate(body["content"], start=shift):
            if block["type"] == "text":
                yield from text
            else:
                yield _event("content_block_start", {"index": i, "content_block": {**block, "input": {}}})
                delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
                yield _event("content_block_delta", {"index": i, "delta": delta})
            yield _event("content_block_stop", {"index": i})
        delta = {"stop_reason": body["stop_reason"], "stop_sequence": body["stop_sequence"]}
        yield _event(
            "message_delta", {"delta": delta, "usage": {"output_tokens": body["usage"]["output_tokens"]}}
        )
        yield _event("message_stop", {})

    return live.sse(
        [_event("message_start", {"message": start})],
        lambda: [_event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})],
        lambda piece: _event(
            "content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": piece}}
        ),
        lambda e: _event("error", {"error": e.anthropic_body()["error"]}),
        end,
    )
