"""The OpenAI Responses wire (`POST /v1/responses`, as Codex and the Agents SDK send it): request schema,
conversion to a `ChatRequest`, the response and its SSE event sequence.

Honoured: `input` as a string or items - messages (roles user/system/developer/assistant; `input_text`,
`output_text` and `input_image` parts), `function_call`/`custom_tool_call` items and their outputs, `reasoning`
items (their text goes to the next assistant turn's `reasoning_content` where the template renders one, else it is
dropped, as on the Anthropic wire), `additional_tools` items (their tools join `tools`: Codex sends its default
model its tools there) - `instructions` (a system message first), function `tools`, `tool_choice`,
`max_output_tokens` (left out: the session's default, see `server.py`), `temperature`, `top_p`, `stop`, `stream`,
`previous_response_id`, `text.format` json_schema/json_object (constrained decoding, `errors.output_schema`).
`custom` tools whose input is a grammar (Lark or regex; Codex's default model's `exec`) and `strict` function
tools constrain the reply (`Session._constrain`, `tools.call_grammar`). `strict` left out is the Responses
default, true, where the tool parser has a grammar (every format's but `none`); where it has none it is false,
so that a harness that never names it still runs, while an explicit `strict: true` there is a 400
(docs/harnesses.md; the Agents SDK names it: its function tools are strict unless `function_tool(strict_mode=False)`). A grammar tool (hermes format only, a 400 elsewhere) is
offered as a function of one string whose description holds the grammar, and its raw input is the call's
`arguments` as written (`<tool_call>\n{"name": "exec", "arguments": RAW}\n</tool_call>`), which a template that
prints a string verbatim renders back token-exact when the client resends the `custom_tool_call` (docs/harnesses.md).
A custom tool of another format type is refused (400), as is a grammar llguidance cannot compile as sent or once
inlined (a recursive one: its rules become terminals; `%ignore`), naming `tools[<name>]`. A resent
`custom_tool_call`'s input is the call's arguments as they are, never JSON-decoded. A free-text `custom` tool is offered
to the model as a function of one string, `input`; a call to it comes back as a `custom_tool_call` item with that string (arguments without a
string `input` come back as their JSON text, and then, sent back, do not extend the segment; the recorded tools of
`previous_response_id` are functions, so a request that relies on them gets `function_call` items). `namespace`
tools offer their tools by their own names (a call carries its `namespace` back); hosted tools (`HOSTED`: web
search, file search, ...) are not shown to the model, since a model server runs none of them. Accepted and ignored:
`store`, `include`, `reasoning`, `parallel_tool_calls` (the model decides how many calls to write),
`prompt_cache_key`, `client_metadata`, `metadata`, `truncation`, `user`, ... .

State: nothing is stored beyond the session. `previous_response_id` names one of the session's latest 64
replies (`Session.recall`); its conversation, reply included, comes before `input`, and its tools apply when
the request sends none. New `instructions` replace the recorded ones (a leading system message), none keep
them. Unknown or forgotten ids are a 400 `previous_response_not_found`; `store: false` with the whole input each
time (Codex) needs no state at all. Either way the continuation rule of `segments.py` decides the segments.

Output: a `message` item with one `output_text` part (left out when the reply is only tool calls), then one
`function_call` (or `custom_tool_call`) item per call; `status` is `incomplete` (`max_output_tokens`) when the
reply hit the token limit. Streaming sends `response.created`, `response.in_progress`, the message item's text
deltas while the engine samples (`molt.capture.streaming`), the call items, and `response.completed` (or
`response.incomplete`), as the official SDK's `responses.stream` assembles them.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

from pydantic import BaseModel, Field

from molt.capture.errors import WireError, output_schema
from molt.capture.openai_wire import stop_list, tool_choice
from molt.capture.render import canonical_messages, canonical_tools, merge_leading_system
from molt.capture.session import ChatRequest, Generation, Session
from molt.capture.streaming import LiveReply
from molt.capture.tools import arguments_json, tool_call


class ResponsesRequest(BaseModel):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    stream: bool | None = False
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None


SCHEMA = ResponsesRequest


def _part(part: dict[str, Any]) -> dict[str, Any]:
    if part.get("type") == "input_image":
        return {"type": "image_url", "image_url": {"url": part.get("image_url") or ""}}
    return {"type": "text", "text": part.get("text") or part.get("refusal") or ""}


def _messages(items: list[dict[str, Any]], session: Session, raw: Any = ()) -> list[dict[str, Any]]:
    """Input items -> OpenAI chat messages: a function call joins the assistant message just before it (or
    starts one), a reasoning item's text the assistant message after it; a call to a tool in `raw` (a grammar
    tool) keeps its input as its arguments string (module docstring)."""
    out: list[dict[str, Any]] = []
    reasoning = ""
    for item in items:
        kind = item.get("type", "message")
        if kind == "reasoning":
            reasoning += "".join(
                p.get("text") or "" for p in item.get("content") or item.get("summary") or []
            )
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": output if isinstance(output, str) else [_part(p) for p in output or []],
                }
            )
        elif kind in ("message", "function_call", "custom_tool_call"):
            if kind == "message" or not (out and out[-1]["role"] == "assistant"):
                content = item.get("content") if kind == "message" else ""
                out.append(
                    {
                        "role": item.get("role", "assistant"),
                        "content": content if isinstance(content, str) else [_part(p) for p in content or []],
                    }
                )
            if out[-1]["role"] == "assistant" and reasoning and session.renderer.reasoning:
                out[-1]["reasoning_content"] = reasoning
            reasoning = "" if out[-1]["role"] == "assistant" else reasoning
            if kind != "message":
                grammar = item["name"] in raw
                args = item.get("input") or ""
                if kind == "function_call":
                    args = item.get("arguments") or "{}"
                elif not grammar:
                    args = {"input": args}
                call = tool_call(item.get("call_id", ""), item["name"], args, grammar)
                out[-1].setdefault("tool_calls", []).append(call)
        elif kind != "additional_tools":  # its tools join the request's (`request_tools`)
            raise WireError(400, f"input: items of type {kind!r} are not supported here", param="input")
    return out


# tools the provider runs itself: a model server runs none, so the model is not shown them (Codex sends web_search)
HOSTED = {
    "web_search",
    "web_search_preview",
    "file_search",
    "code_interpreter",
    "computer_use_preview",
    "image_generation",
    "mcp",
    "local_shell",
    "tool_search",
}


FREE_TEXT = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}


def request_tools(req: ResponsesRequest) -> list[dict[str, Any]]:
    """`tools` and the tools of `additional_tools` input items (Codex sends its default model its tools there)."""
    items = req.input if isinstance(req.input, list) else []
    return (req.tools or []) + [
        t for i in items if i.get("type") == "additional_tools" for t in i.get("tools") or []
    ]


def _functions(
    tools: list[dict[str, Any]], space: str | None = None
) -> list[tuple[dict[str, Any], str | None]]:
    """The function and free-text custom tools with their namespace (None at top level); hosted tools left out,
    others refused. A namespace's tools are offered by their own names; a call to one carries its `namespace`
    back. A custom tool is offered as a function of one string, `input` (module docstring)."""
    found = []
    for t in tools:
        fmt = t.get("format") or {"type": "text"}
        if t.get("type") == "namespace":
            found += _functions(t.get("tools") or [], t.get("name"))
        elif t.get("type") == "function" or (
            t.get("type") == "custom" and fmt.get("type") in ("text", "grammar")
        ):
            found.append((t, space))
        elif t.get("type") == "custom":
            raise WireError(
                400,
                f"tools: the custom tool {t.get('name')!r} has a format of type {fmt.get('type')!r}; "
                "text and grammar are supported",
                code="unsupported_parameter",
                param="tools",
            )
        elif t.get("type") not in HOSTED:
            raise WireError(
                400,
                f"tools: only function tools are supported here, not {t.get('type')!r}",
                code="unsupported_parameter",
                param="tools",
            )
    return found


def _offer(tools: list[dict[str, Any]], strict: bool) -> tuple[list[dict[str, Any]] | None, dict[str, Any]]:
    """(the tools as the model is offered them, tool name -> how its calls are constrained: `ChatRequest.formats`).
    A grammar tool is offered as a function of one string whose description holds the grammar, and its calls
    follow the grammar; a function tool's calls follow its schema where `strict` is true; left out, `strict` is
    true (the Responses API's default) where the server's tool parser has a grammar, false where it has none
    (docs/harnesses.md)."""
    offered, formats = [], {}
    for t, _ in _functions(tools):
        fmt = t.get("format") or {}
        if t.get("type") == "function":
            parameters = t.get("parameters")
            if t.get("strict", strict):
                formats[t["name"]] = {"schema": parameters or {"type": "object"}}
        elif fmt.get("type") == "grammar":
            grammar = f"raw text in this {fmt.get('syntax')} grammar, not JSON:\n{fmt.get('definition')}"
            parameters = {"type": "string", "description": grammar}
            formats[t["name"]] = fmt
        else:
            parameters = FREE_TEXT
        function = {"name": t.get("name"), "description": t.get("description"), "parameters": parameters}
        offered.append({"type": "function", "function": function})
    return canonical_tools(offered), formats


def to_chat(req: ResponsesRequest, data: dict[str, Any], session: Session) -> ChatRequest:
    history, tools = [], None
    if req.previous_response_id:
        found = session.recall(req.previous_response_id)
        if found is None:
            raise WireError(
                400,
                f"previous_response_id: no response {req.previous_response_id!r} in this session",
                code="previous_response_not_found",
                param="previous_response_id",
            )
        history, tools = found
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    if system and history and history[0]["role"] == "system":  # new instructions replace the recorded ones
        history = history[1:]
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else data["input"]
    offered = request_tools(req)
    offered_tools, formats = _offer(offered, getattr(session.parser, "grammar", None) is not None)
    raw = {name for name, f in formats.items() if "schema" not in f}
    messages = merge_leading_system(
        system + history + canonical_messages(_messages(items, session, raw), session.renderer.image, raw)
    )
    if req.tools is not None or offered:
        tools = offered_tools
    choice, name = tool_choice(req.tool_choice)
    params = session.sampling(max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p)
    return ChatRequest(
        messages,
        tools,
        params,
        stop_list(req.stop),
        parse_tools=bool(tools) and choice != "none",
        tool_choice=choice,
        tool_name=name,
        formats=formats,
        output=output_schema((req.text or {}).get("format"), "text.format"),
    )


def _body(
    req: ResponsesRequest,
    rid: str,
    created: int,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "id": f"resp_{rid}",
        "object": "response",
        "created_at": created,
        "status": status,
        "model": req.model,
        "output": output,
        "instructions": req.instructions,
        "tools": req.tools or [],
        "tool_choice": req.tool_choice or "auto",
        "parallel_tool_calls": True,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id,
        "text": {"format": {"type": "text"}},
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "error": None,
        "metadata": {},
        "usage": usage,
    }


def _message(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def response_body(gen: Generation, req: ResponsesRequest, session: Session | None = None) -> dict[str, Any]:
    ch = gen.choices[0]
    status = "incomplete" if ch.finish_reason == "length" else "completed"
    output = [_message(f"msg_{gen.id}", ch.content, status)] if ch.content or not ch.tool_calls else []
    known = {t["name"]: (t["type"], space) for t, space in _functions(request_tools(req))}
    for c in ch.tool_calls:
        kind, ns = known.get(c["function"]["name"], ("function", None))
        args = c["function"]["arguments"]
        if kind == "function":
            item = {"type": "function_call", "id": f"fc_{c['id']}", "arguments": arguments_json(c)}
        else:
            free_text = isinstance(args, dict) and isinstance(args.get("input"), str)
            text = args["input"] if free_text else arguments_json(c)
            item = {"type": "custom_tool_call", "id": f"ctc_{c['id']}", "input": text}
        output.append(
            item
            | {"call_id": c["id"], "name": c["function"]["name"], "status": "completed"}
            | ({"namespace": ns} if ns else {})
        )
    prompt, completion = len(gen.prompt_ids), len(ch.action_ids)
    usage = {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }
    return _body(req, gen.id, gen.created, status, output, usage)


def stream(live: LiveReply, req: ResponsesRequest, session: Session | None = None) -> AsyncIterator[bytes]:
    """The event sequence of the module docstring. A failure after the first byte ends it with an error event."""
    seq = itertools.count()

    def event(kind: str, **data: Any) -> bytes:
        body = {"type": kind, "sequence_number": next(seq), **data}
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n".encode()

    msg_id = f"msg_{live.id}"
    text_at = {"item_id": msg_id, "output_index": 0, "content_index": 0}

    def open_text() -> list[bytes]:
        item = {**_message(msg_id, "", "in_progress"), "content": []}
        part = _message(msg_id, "")["content"][0]
        return [
            event("response.output_item.added", output_index=0, item=item),
            event("response.content_part.added", **text_at, part=part),
        ]

    def delta(piece: str) -> bytes:
        return event("response.output_text.delta", **text_at, delta=piece, logprobs=[])

    def error(e: WireError) -> bytes:
        body = e.openai_body()["error"]
        return event("error", code=body["code"], message=body["message"], param=body["param"])

    def end(gen: Generation, text: Iterator[bytes]) -> Iterator[bytes]:
        body = response_body(gen, req)
        if live.sent and body["output"][0]["type"] != "message":  # a stream mismatch: the text sent
            body["output"].insert(0, _message(msg_id, live.sent, body["status"]))
        for i, item in enumerate(body["output"]):
            if item["type"] == "message":
                yield from text
                part = item["content"][0]
                yield event("response.output_text.done", **text_at, text=part["text"], logprobs=[])
                yield event("response.content_part.done", **text_at, part=part)
            else:
                field = "arguments" if "arguments" in item else "input"
                kind = "function_call_arguments" if "arguments" in item else "custom_tool_call_input"
                at = {"item_id": item["id"], "output_index": i}
                yield event(
                    "response.output_item.added",
                    output_index=i,
                    item={**item, field: "", "status": "in_progress"},
                )
                yield event(f"response.{kind}.delta", **at, delta=item[field])
                yield event(f"response.{kind}.done", **at, name=item["name"], **{field: item[field]})
            yield event("response.output_item.done", output_index=i, item=item)
        yield event(f"response.{body['status']}", response=body)

    head = _body(req, live.id, live.created, "in_progress", [], None)
    start = [event("response.created", response=head), event("response.in_progress", response=head)]
    return live.sse(start, open_text, delta, error, end)
