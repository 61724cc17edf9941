"""The OpenAI Chat Completions wire: request schema, conversion to a `ChatRequest`, response and SSE stream.

Supported: messages (system/developer/user/assistant/tool; text and `image_url` content parts, images for
vision-language models as `molt.capture.render` says; assistant `tool_calls`), `tools`
and `tool_choice`, `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `stop`, `n`, `seed`,
`logprobs` / `top_logprobs`, `stream` with `stream_options.include_usage`, and the vLLM-style extensions
`top_k`, `min_tokens`. Unknown fields (penalties, `user`, ...) are ignored; fields left out take the session's
sampling defaults (the rollout's; a left-out `max_tokens` where none is set: the rest of the context window; a
left-out `seed`: the call's own, `molt.types`). `response_format` json_schema / json_object is honoured by
constrained decoding (`errors.output_schema`). `tool_choice="none"` returns tool-call text as plain content; "required" or a named function (`{"type": "function", "function":
{"name": ...}}`) prefill the reply with the call opening and constrain the rest to a call (`Session._constrain`);
`strict: true` tools' arguments follow their schema (a 400 where the tool parser's format has no grammar); `response_format` beside tools constrains a text reply, and a
reply is that JSON or calls (a forced call: the call).

Streaming: content deltas go out as the engine samples (`molt.capture.streaming`), then tool-call deltas (id
and name first, then the arguments), a finish chunk, the usage chunk when asked, and `[DONE]` - the sequence
the official SDK assembles into the same message a non-streaming request returns.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

from pydantic import BaseModel, Field

from molt.capture.errors import WireError, output_schema
from molt.capture.render import canonical_messages, canonical_tools
from molt.capture.session import ChatRequest, Choice, Generation, Session
from molt.capture.streaming import LiveReply, text_pieces
from molt.capture.tools import arguments_json


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model: str
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    min_tokens: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)
    seed: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None  # `errors.output_schema`


SCHEMA = ChatCompletionRequest


def to_chat(req: ChatCompletionRequest, data: dict[str, Any], session: Session) -> ChatRequest:
    """The request in wire-independent form; messages and tools are read from the validated JSON `data`."""
    params = session.sampling(
        max_tokens=req.max_completion_tokens or req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_tokens=req.min_tokens,
        seed=req.seed,
        top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
    )
    tools = canonical_tools(data.get("tools"))
    choice, name = tool_choice(req.tool_choice)
    strict = {
        f["name"]: {"schema": f.get("parameters") or {"type": "object"}}
        for f in (t["function"] for t in tools or [])
        if f.get("strict")
    }  # constrained (session._constrain)
    return ChatRequest(
        canonical_messages(data["messages"], session.renderer.image),
        tools,
        params,
        stop_list(req.stop),
        req.n,
        parse_tools=bool(tools) and choice != "none",
        tool_choice=choice,
        tool_name=name,
        formats=strict,
        output=output_schema(req.response_format, "response_format"),
    )


def stop_list(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def tool_choice(choice: str | dict[str, Any] | None) -> tuple[str, str | None]:
    """(choice, function name) of a `tool_choice`: an OpenAI string, or a dict as Chat Completions (a named
    `{"type": "function", "function": {"name"}}`), Responses (`{"type": "function" or "custom", "name"}`) or
    Anthropic (`{"type": "auto" | "none" | "any" | "tool"}`, "tool" with a name) writes it."""
    if not isinstance(choice, dict):
        return choice or "auto", None
    kind, name = choice.get("type"), (choice.get("function") or choice).get("name")
    if kind in ("auto", "none", "any"):
        return "required" if kind == "any" else kind, None
    if kind not in ("function", "custom", "tool") or not isinstance(name, str):
        raise WireError(
            400,
            'tool_choice must be "none", "auto", "required" or a named function (tool): '
            '{"type": "function", "name": ...}',
            code="invalid_request",
            param="tool_choice",
        )
    return "function", name


def _usage(gen: Generation) -> dict[str, int]:
    prompt, completion = len(gen.prompt_ids), gen.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _logprobs(choice: Choice, session: Session) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = session.renderer.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    tops = choice.top_logprobs or [[] for _ in choice.action_ids]
    return {
        "content": [
            {**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in top]}
            for t, lp, top in zip(choice.action_ids, choice.logprobs, tops)
        ],
        "refusal": None,
    }


def _calls(choice: Choice) -> list[dict[str, Any]]:
    return [
        {
            "id": c["id"],
            "type": "function",
            "function": {"name": c["function"]["name"], "arguments": arguments_json(c)},
        }
        for c in choice.tool_calls
    ]


def response_body(gen: Generation, req: ChatCompletionRequest, session: Session) -> dict[str, Any]:
    choices = []
    for i, ch in enumerate(gen.choices):
        message: dict[str, Any] = {
            "role": "assistant",
            "content": ch.content if ch.content or not ch.tool_calls else None,
            "refusal": None,
        }
        if ch.tool_calls:
            message["tool_calls"] = _calls(ch)
        choices.append(
            {
                "index": i,
                "message": message,
                "finish_reason": ch.finish_reason,
                "logprobs": _logprobs(ch, session) if req.logprobs else None,
            }
        )
    return {
        "id": f"chatcmpl-{gen.id}",
        "object": "chat.completion",
        "created": gen.created,
        "model": req.model,
        "choices": choices,
        "usage": _usage(gen),
        "system_fingerprint": None,
    }


def stream(live: LiveReply, req: ChatCompletionRequest, session: Session) -> AsyncIterator[bytes]:
    """Role chunk, content deltas while the engine samples (streaming.py), then the rest of the content,
    tool-call deltas (id and name first, then the arguments), the finish chunk (with the logprobs when asked),
    the usage chunk when asked, `[DONE]`. A failure after the first byte ends the stream with an error event."""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    head = {
        "id": f"chatcmpl-{live.id}",
        "object": "chat.completion.chunk",
        "created": live.created,
        "model": req.model,
        "system_fingerprint": None,
    }

    def data(body: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> bytes:
        body = {
            **head,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        }
        if include_usage:
            body["usage"] = None
        return data(body)

    def role(i: int) -> bytes:
        return chunk(i, {"role": "assistant", "content": ""})

    def end(gen: Generation, rest: Iterator[bytes]) -> Iterator[bytes]:
        for i, ch in enumerate(gen.choices):
            if i:
                yield role(i)
                rest = (chunk(i, {"content": piece}) for piece in text_pieces(ch.content))
            yield from rest
            for j, call in enumerate(_calls(ch)):
                function = call["function"]
                yield chunk(
                    i, {"tool_calls": [{"index": j, **call, "function": {**function, "arguments": ""}}]}
                )
                yield chunk(
                    i, {"tool_calls": [{"index": j, "function": {"arguments": function["arguments"]}}]}
                )
            yield chunk(
                i, {}, finish=ch.finish_reason, logprobs=_logprobs(ch, session) if req.logprobs else None
            )
        if include_usage:
            yield data({**head, "choices": [], "usage": _usage(gen)})
        yield b"data: [DONE]\n\n"

    return live.sse(
        [role(0)],
        list,  # nothing more opens the text: the role chunk did
        lambda piece: chunk(0, {"content": piece}),
        lambda e: data(e.openai_body()),
        end,
    )
