"""Tool-call parsers: generated text -> (content, tool calls). A registry, so models with other formats plug in.

Design notes and decisions: docs/internals.md, section `molt/capture/tools.py`.
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from molt.types import JSON_STYLE, json_lark


@dataclass
class Parsed:
    content: str
    calls: list[dict[str, Any]] = field(default_factory=list)
    malformed: int = 0


ToolParser = Callable[[str], Parsed]
_PARSERS: dict[str, ToolParser] = {}


def register_tool_parser(name: str, opening: Callable[[str | None], str] | None = None, markers: tuple[str, ...] = (),
                         grammar: Callable[..., str] | None = None) -> Callable[[ToolParser], ToolParser]:
    """opening(tool name or None) -> the text that starts a call (to any tool when None), used to force calls;
    a parser registered without one cannot force them. `markers`: the tokens its format is written with, kept
    in the text it parses even where a tokenizer marks them special. `grammar(tools, name, text, token)`: the
    Lark grammar of a reply in this format (`hermes_grammar`); a parser without one takes no grammar or strict
    tools. A parser with one also takes `raw`: the names of tools whose input is raw text, not JSON."""
    def add(parser: ToolParser) -> ToolParser:
        parser.opening, parser.markers, parser.grammar = opening, markers, grammar  # type: ignore[attr-defined]
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
_LARK = re.compile(r'//[^\n]*|"(?:\\.|[^"\\])*"|/(?:\\.|[^/\\\n])+/[imsux]*|[A-Za-z_]\w*')  # comment|string|regex|name
_RAW = re.compile(r'\s*\{"name": "([^"]+)", "arguments": (.*)\}\s*', re.DOTALL)  # a raw-input call (module docstring)


def _hermes_opening(name: str | None) -> str:
    # the exact prefix Qwen/Hermes templates render before a call (`{"name": ..., "arguments": ...}`)
    return "<tool_call>\n" if name is None else f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": '


def hermes_grammar(tools: dict[str, dict[str, Any]], name: str | None, text: str | None,
                   token: Callable[[str], str]) -> str:
    """The Lark grammar of a Hermes reply: free text without a call opening (or `text`, a Lark expression) or
    text (none with `text`) then calls; after `_hermes_opening(name)` when `name` is given ("" forces a call).
    `tools`: name -> {"schema": the arguments' JSON schema} or a custom tool's `format` (grammar or regex); a
    custom tool's raw input and the call's closing `}\n` are one terminal, so that llguidance's greedy lexer
    ends the input where the call does. `token(marker)`: the marker as a Lark token (`<[id]>`)."""
    o, c, rules, nl = token("<tool_call>"), token("</tool_call>"), [], r'"\n"'
    for i, (tool, spec) in enumerate(tools.items()):
        if "schema" in spec:
            rules.append(f'args{i}: {json_lark(spec["schema"], JSON_STYLE)} "}}\\n"')
        else:  # its terminals and rules become terminals T{i}_NAME, T{i}R_NAME: a recursive grammar fails to compile (400)
            lark = spec.get("definition", "")
            lark = "start: /" + lark.replace("/", "\\/") + "/" if spec.get("syntax") == "regex" else lark
            rules += [_LARK.sub(lambda m, i=i: m[0] if m[0][0] in '"/' else f"T{i}{'_' if m[0].isupper() else 'R_'}"
                                f"{m[0].upper()}", re.sub(r"^[?!]", "", lark, flags=re.MULTILINE)),
                      f'T{i}: T{i}R_START "}}\\n"', f"args{i}: T{i}"]
        rules.append(f"body{i}: {json.dumps(_hermes_opening(tool).split(chr(10), 1)[1])} args{i}")
    call = f"({' | '.join(f'body{i}' for i in range(len(tools)))}) {c}"
    prose = f"{text} |" if text else "TEXT | BODY?"  # a text reply (no text before calls with `text`), or a call
    start = f"args{list(tools).index(name)} {c}" if name else f"{call} calls" if name == "" else \
        f"{prose} {o} {nl} {call} calls"
    return "\n".join([f"start: {start}", f"calls: ({nl} {o} {nl} {call})*", *rules,
                      "TEXT: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/", r"BODY: /(?s:.*)\S\n/ & ~/(?s:.*)<tool_call>(?s:.*)/"])


@register_tool_parser("hermes", opening=_hermes_opening, markers=("<tool_call>", "</tool_call>"), grammar=hermes_grammar)
def _hermes(text: str, raw: Collection[str] = ()) -> Parsed:
    calls, kept, pos = [], [], 0
    for match in _HERMES.finditer(text):
        found = _RAW.fullmatch(match.group(1)) if raw else None
        try:
            if found and found[1] in raw:  # kept as the string it is (a template prints a string verbatim)
                name, args = found[1], found[2]
            else:
                obj = json.loads(match.group(1))
                name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
                args = json.loads(args) if isinstance(args, str) else args
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
