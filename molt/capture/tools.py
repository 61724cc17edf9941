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


def new_call_id(prefix: str = "call_", size: int = 24) -> str:
    return prefix + uuid.uuid4().hex[:size]


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


register_tool_parser("none")(lambda text: Parsed(text))


_BAD = (ValueError, KeyError, TypeError, AttributeError)  # what reading a malformed call raises
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_LARK = re.compile(r'//[^\n]*|"(?:\\.|[^"\\])*"|/(?:\\.|[^/\\\n])+/[imsux]*|[A-Za-z_]\w*')  # comment|string|regex|name
_RAW = re.compile(r'\s*\{"name": "([^"]+)", "arguments": (.*)\}\s*', re.DOTALL)  # a raw-input call (module docstring)


def _json_call(obj: Any, call_id: str | None = None) -> dict[str, Any]:
    """A call written as a JSON object {"name": ..., "arguments" (or Llama's "parameters"): {...}}."""
    call = tool_call(call_id or new_call_id(), obj["name"], obj.get("arguments", obj.get("parameters", {})))
    if not isinstance(call["function"]["name"], str) or not isinstance(call["function"]["arguments"], dict):
        raise TypeError
    return call


def _split(text: str, pattern: re.Pattern, read: Callable[[re.Match], list[dict[str, Any]]], opened: int,
           strip: bool = True) -> Parsed:
    """The calls in the matches of `pattern` as `read` reads them (raising on a malformed block, which then stays
    in the content); `opened`: the blocks the text starts, so the ones not read count as malformed. The text
    around the calls is the content, rstripped where the template writes a newline before a call (a streamed
    reply has sent its leading text already, see streaming.py)."""
    calls, kept, pos = [], [], 0  # kept: the text before each block read
    for match in pattern.finditer(text):
        try:
            calls += read(match)
        except _BAD:
            continue
        kept, pos = [*kept, text[pos:match.start()]], match.end()
    content = "".join(kept) + text[pos:] if calls else text
    return Parsed(content.rstrip() if strip and calls else content, calls, opened - len(kept))


def _format(name: str, pattern: re.Pattern, read: Callable[[re.Match], list[dict[str, Any]]], opener: str,
            opening: Callable[[str | None], str], markers: tuple[str, ...], strip: bool = True) -> ToolParser:
    """Register a format whose calls are blocks that start with `opener` (`_split`)."""
    return register_tool_parser(name, opening, markers)(
        lambda text: _split(text, pattern, read, len(re.findall(opener, text)), strip))


def _hermes_opening(name: str | None) -> str:
    # the exact prefix Qwen/Hermes templates render before a call (`{"name": ..., "arguments": ...}`)
    return "<tool_call>\n" + (f'{{"name": {json.dumps(name)}, "arguments": ' if name else "")


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


def _hermes_read(match: re.Match, raw: Collection[str]) -> list[dict[str, Any]]:
    found = _RAW.fullmatch(match.group(1)) if raw else None
    if found and found[1] in raw:  # kept as the string it is (a template prints a string verbatim)
        return [tool_call(new_call_id(), found[1], found[2])]
    return [_json_call(json.loads(match.group(1)))]


@register_tool_parser("hermes", _hermes_opening, ("<tool_call>", "</tool_call>"), hermes_grammar)
def _hermes(text: str, raw: Collection[str] = ()) -> Parsed:
    """`raw`: the tools whose input is raw text (grammar tools), read as the string they are."""
    return _split(text, _HERMES, lambda m: _hermes_read(m, raw), text.count("<tool_call>"))


_XML_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _xml_value(raw: str) -> Any:
    """A parameter's value, typed where the type renders back to the same text (the template writes objects and
    lists as JSON, other values with `string`): "42" -> 42, but "true" stays "true" (it would come back "True")."""
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    return value if (json.dumps(value, ensure_ascii=False) if isinstance(value, dict | list) else str(value)) == raw else raw


_format("qwen3_coder", _XML_CALL, lambda m: [tool_call(new_call_id(), m.group(1).strip(), {
    k: _xml_value(v) for k, v in _XML_PARAM.findall(m.group(2))})], "<tool_call>",
    lambda name: "<tool_call>\n" + (f"<function={name}>\n" if name else ""), ("<tool_call>", "</tool_call>"))

# a call is the whole reply, one JSON object (the template renders one call a turn), after an optional python tag
_format("llama3_json", re.compile(r"\A\s*(?:<\|python_tag\|>)?\s*(\{.*\})\s*\Z", re.DOTALL),
        lambda m: [_json_call(json.loads(m.group(1)))], r"\A\s*(?:<\|python_tag\|>)?\s*\{",
        lambda name: '{"name": "' + (f'{name}", "parameters": ' if name else ""), ("<|python_tag|>",))


# `[TOOL_CALLS]` then a JSON list of calls (v3, Nemo), or name[ARGS]{...} per call, [CALL_ID]id between (v11+)
_MISTRAL = re.compile(r"\[TOOL_CALLS\]\s*(?:(\[.*?\])|([^\[\]{}\s]+)(?:\[CALL_ID\](\w+))?\[ARGS\](\{.*?\}))"
                      r"(?=\s*(?:\[TOOL_CALLS\]|$))", re.DOTALL)


def _mistral_read(m: re.Match) -> list[dict[str, Any]]:
    """Mistral's templates write call ids back (and refuse any but 9 alphanumerics): the model's own are kept."""
    if m.group(1):
        return [_json_call(obj, str(obj.get("id") or new_call_id("", 9))) for obj in json.loads(m.group(1))]
    return [tool_call(m.group(3) or new_call_id("", 9), m.group(2), json.loads(m.group(4)))]


_MISTRAL_MARKERS = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
_format("mistral", _MISTRAL, _mistral_read, r"\[TOOL_CALLS\]", lambda name: "[TOOL_CALLS]" + (
    f'[{{"name": "{name}", "arguments": ' if name else ""), _MISTRAL_MARKERS, strip=False)
_format("mistral_v11", _MISTRAL, _mistral_read, r"\[TOOL_CALLS\]", lambda name: "[TOOL_CALLS]" + (name or ""),
        _MISTRAL_MARKERS, strip=False)

# auto: (what a chat template's text holds, the parser of its call format), the first match; none -> hermes
_FORMATS = ((("<tool_call>", "<function="), "qwen3_coder"), (("<tool_call>",), "hermes"), (("[ARGS]",), "mistral_v11"),
            (("[TOOL_CALLS]",), "mistral"), (("<|python_tag|>",), "llama3_json"),
            (('"parameters"', "ipython"), "llama3_json"))


def choose_tool_parser(name: str, template: str, tokenizer: Any = None) -> ToolParser:
    """The parser `name`; for "auto" the model's own (a tokenizer with a `response_template` for tool calls),
    else the one whose format the chat template writes (docs/internals.md)."""
    if name != "auto":
        return get_tool_parser(name)
    family = get_tool_parser(next((p for marks, p in _FORMATS if all(m in template for m in marks)), "hermes"))
    spec = (getattr(tokenizer, "response_template", None) or {}).get("fields", {}).get("tool_calls")
    if spec is None:
        return family

    def own(text: str, raw: Collection[str] = ()) -> Parsed:
        if raw:  # grammar tools: the reply follows the family's grammar, so the family's parser reads it
            return family(text, raw=raw)  # type: ignore[call-arg]
        try:
            calls = [tool_call(new_call_id(), c["function"]["name"], c["function"].get("arguments", {}))
                     for c in tokenizer.parse_response(text, prefix="").get("tool_calls") or []]
        except _BAD:  # a call it cannot read: the template format's parser keeps it as text and counts it
            return family(text)
        # the content: the reply before its first call, as generated (an `open` list of literals is not read)
        first = re.search(spec.get("open_pattern") or re.escape(spec["open"]), text, re.DOTALL)
        return Parsed(text[:first.start()].rstrip() if first else text, calls) if calls else Parsed(text)
    own.opening, own.markers, own.grammar = family.opening, family.markers, family.grammar  # type: ignore[attr-defined]
    return own
