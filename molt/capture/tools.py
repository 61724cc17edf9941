"""Tool-call parsers: generated text -> (content, tool calls). A registry, so models with other formats plug in.

Design notes and decisions: docs/internals.md, section `molt/capture/tools.py`.
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Parsed:
    content: str
    calls: list[dict[str, Any]] = field(default_factory=list)
    malformed: int = 0


ToolParser = Callable[[str], Parsed]
_PARSERS: dict[str, ToolParser] = {}


def register_tool_parser(name: str, opening: Callable[[str | None], str] | None = None, markers: tuple[str, ...] = ()
                         ) -> Callable[[ToolParser], ToolParser]:
    """opening(tool name or None) -> the text that starts a call (to any tool when None), used to force calls;
    a parser registered without one cannot force them. `markers`: the tokens its format is written with, kept
    in the text it parses even where a tokenizer marks them special."""
    def add(parser: ToolParser) -> ToolParser:
        parser.opening, parser.markers = opening, markers  # type: ignore[attr-defined]
        _PARSERS[name] = parser
        return parser
    return add


def call_opening(parser: ToolParser, name: str | None) -> str | None:
    """The text that forces `parser`'s call format (a call to `name`, or to any tool); None if it cannot."""
    opening = getattr(parser, "opening", None)
    return None if opening is None else opening(name)


def get_tool_parser(name: str) -> ToolParser:
    if name not in _PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; registered: {sorted(_PARSERS)}")
    return _PARSERS[name]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    """A canonical tool call (arguments a dict when they are valid JSON, else the raw string)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def arguments_json(call: dict[str, Any]) -> str:
    args = call["function"]["arguments"]
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


@register_tool_parser("none")
def _no_parsing(text: str) -> Parsed:
    return Parsed(text)


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _hermes_opening(name: str | None) -> str:
    # the exact prefix Qwen/Hermes templates render before a call (`{"name": ..., "arguments": ...}`)
    return "<tool_call>\n" if name is None else f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": '


@register_tool_parser("hermes", opening=_hermes_opening, markers=("<tool_call>", "</tool_call>"))
def _hermes(text: str) -> Parsed:
    calls, kept, pos = [], [], 0
    for match in _HERMES.finditer(text):
        try:
            obj = json.loads(match.group(1))
            name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(name, str) or not isinstance(args, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # malformed: the block stays in the content
        kept.append(text[pos:match.start()])
        pos = match.end()
        calls.append(tool_call(new_call_id(), name, args))
    malformed = text.count("<tool_call>") - len(calls)
    if not calls:
        return Parsed(text, [], malformed)
    # rstrip only: the newline before a call goes, leading text stays as generated (a streamed reply has
    # sent it already, see streaming.py)
    return Parsed(("".join(kept) + text[pos:]).rstrip(), calls, malformed)
