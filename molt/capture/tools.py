"""Tool-call parsers: generated text -> (content, tool calls). A registry, so models with other formats plug in.

Design notes and decisions: docs/internals.md, section `molt/capture/tools.py`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from molt.types import JSON_STYLE, check_grammar, json_lark


@dataclass
class Parsed:
    content: str
    calls: list[dict[str, Any]] = field(default_factory=list)
    malformed: int = 0


ToolParser = Callable[..., Parsed]
_PARSERS: dict[str, ToolParser] = {}


def register_tool_parser(
    name: str,
    opening: Callable[[str | None], str] | None = None,
    markers: tuple[str, ...] = (),
    grammar: Callable[..., str] | None = None,
) -> Callable[[ToolParser], ToolParser]:
    """opening(tool name or None) -> the text that starts a call (to any tool when None), used to force calls;
    a parser registered without one cannot force them. `markers`: the tokens its format is written with, kept
    in the text it parses even where a tokenizer marks them special. `grammar(tools, name, text, token)`: the
    Lark grammar of a reply in this format (`call_grammar`); a parser without one takes no grammar or strict
    tools. A parser is called with the text and `tools`: name -> {"schema": the arguments' schema} or a grammar
    tool's format (whose input hermes reads as raw text, not JSON); qwen3_coder types values by the schema."""

    def add(parser: ToolParser) -> ToolParser:
        parser.opening, parser.markers, parser.grammar = opening, markers, grammar  # type: ignore[attr-defined]
        _PARSERS[name] = parser
        return parser

    return add


def call_opening(parser: ToolParser, name: str | None) -> str | None:
    """The text that forces `parser`'s call format (a call to `name`, or to any tool); None if it cannot."""
    return (getattr(parser, "opening", None) or (lambda _: None))(name)


def get_tool_parser(name: str) -> ToolParser:
    if name not in _PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; registered: {sorted(_PARSERS)}")
    return _PARSERS[name]


def new_call_id(prefix: str = "call_", size: int = 24) -> str:
    return prefix + uuid.uuid4().hex[:size]


def tool_call(call_id: str, name: str, arguments: Any, raw: bool = False) -> dict[str, Any]:
    """A canonical tool call (arguments a dict when they are valid JSON, else the raw string); `raw`: a grammar
    tool's input, kept as the string it is (`1.50` stays `1.50`, "" stays "")."""
    if isinstance(arguments, str) and not raw:
        with suppress(json.JSONDecodeError):
            arguments = json.loads(arguments) if arguments.strip() else {}
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def arguments_json(call: dict[str, Any]) -> str:
    args = call["function"]["arguments"]
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


register_tool_parser("none")(lambda text, tools=None: Parsed(text))


_BAD = (ValueError, KeyError, TypeError, AttributeError)  # what reading a malformed call raises
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
# comment|string|regex|import (`%import common.LF -> ALIAS`, `%import common (LF, WS)`)|directive|alias|name
_LARK = re.compile(
    r'//[^\n]*|"(?:\\.|[^"\\])*"i?|/(?:\\.|[^/\\\n])+/[imsux]*|%import\s+(?P<path>[\w.]+?)(?:\.(?P<one>\w+)(?!\.)'
    r"(?:[ \t]*->[ \t]*(?P<to>\w+))?|\s*\((?P<names>[\w\s,]*)\))|%\w+|(?P<alias>->\s*\w+)|(?P<name>[A-Za-z_]\w*)"
)
# a raw-input call (module docstring)
_RAW = re.compile(r'\s*\{"name": "([^"]+)", "arguments": (.*)\}\s*', re.DOTALL)


def _json_call(obj: Any, call_id: str | None = None) -> dict[str, Any]:
    """A call written as a JSON object {"name": ..., "arguments" (or Llama's "parameters"): {...}}."""
    call = tool_call(call_id or new_call_id(), obj["name"], obj.get("arguments", obj.get("parameters", {})))
    if not isinstance(call["function"]["name"], str) or not isinstance(call["function"]["arguments"], dict):
        raise TypeError
    return call


def _format(
    name: str,
    pattern: re.Pattern,
    read: Callable[[re.Match, dict], list[dict[str, Any]]],
    opener: str,
    opening: Callable[[str | None], str],
    markers: tuple[str, ...],
    strip: bool = True,
    grammar: dict[str, Any] | None = None,
) -> ToolParser:
    """Register a format whose calls are the matches of `pattern`, as `read(match, tools)` reads them (raising on
    a malformed block, which then stays in the content); blocks that start with `opener` but are not read count
    as malformed. The text around the calls is the content, rstripped where the template writes a newline
    before a call (a streamed reply has sent its leading text already, see streaming.py). `grammar`: the
    format's shape (`call_grammar`'s keywords), None for a format without one."""

    def parse(text: str, tools: dict[str, dict[str, Any]] | None = None) -> Parsed:
        calls, kept, pos = [], [], 0  # kept: the text before each block read
        for match in pattern.finditer(text):
            try:
                calls += read(match, tools or {})
            except _BAD:
                continue
            kept, pos = [*kept, text[pos : match.start()]], match.end()
        content = "".join(kept) + text[pos:] if calls else text
        return Parsed(
            content.rstrip() if strip and calls else content, calls, len(re.findall(opener, text)) - len(kept)
        )

    return register_tool_parser(
        name, opening, markers, grammar and call_grammar(opening, markers, **grammar)
    )(parse)


def _inline(tool: str, i: int, spec: dict[str, Any], close: str, raw: bool) -> list[str]:
    """A grammar tool's grammar (`format`: Lark or regex) inlined as terminals: its terminals T{i}_NAME, its rules
    T{i}R_NAME (imported names renamed alike; aliases dropped, they only name tree nodes), and T{i}, its input
    then `close`, one terminal, so that llguidance's greedy lexer ends the input where the call does. A rule
    that recurses cannot become a terminal (llguidance's error on the inlined names), `%ignore` cannot hold inside
    one, and a format without `raw` cannot hold the input: 400s naming the tool."""
    if not raw:
        raise ValueError(
            f"tools[{tool}]: its input is raw text, which this server's tool-call format cannot hold"
        )
    source = spec.get("definition", "")
    source = "start: /" + source.replace("/", "\\/") + "/" if spec.get("syntax") == "regex" else source
    if re.search(r"^\s*%ignore", check_grammar(source, f"tools[{tool}]"), re.MULTILINE):
        raise ValueError(
            f"tools[{tool}]: %ignore is not supported in a grammar tool (its input is one terminal)"
        )

    def new(name: str) -> str:
        return f"T{i}{'_' if name.isupper() else 'R_'}{name.upper()}"

    def rename(m: re.Match) -> str:
        if m["path"]:
            if m["one"]:
                names = [(m["one"], m["to"])]
            else:
                names = [(n, None) for n in re.findall(r"\w+", m["names"] or "")]
            return "\n".join(f"%import {m['path']}.{n} -> {new(to or n)}" for n, to in names)
        if m["alias"]:
            return ""
        return new(m["name"]) if m["name"] else m[0]

    return [
        _LARK.sub(rename, re.sub(r"^(\s*)[?!]", r"\1", source, flags=re.MULTILINE)),
        f"T{i}: T{i}R_START {json.dumps(close)}",
    ]


def call_grammar(
    opening: Callable[[str | None], str],
    markers: tuple[str, ...],
    close: tuple[Any, ...],
    sep: tuple[Any, ...] | None,
    avoid: str,
    prose: str | None = None,
    end: tuple[Any, ...] = (),
    raw: bool = False,
    args: Callable[..., list[str]] = lambda schema, *_: [json_lark(schema, JSON_STYLE)],
) -> Callable[..., str]:
    """The `grammar` builder of a format whose calls are `opening(name)`, the arguments, then `close`; calls
    follow `opening(None)`, between them `sep` (None: one call a reply), after them `end`. Pieces are text, whose
    markers become tokens, or regexes. A reply without calls is text that does not match `avoid` (what the parser
    would take for a call); `prose`: the text allowed before calls (None: none, the template drops it). `raw`:
    the parser reads grammar tools' raw input (`_hermes_read`), which with the text of `close[0]` is one terminal,
    so that llguidance's greedy lexer ends the input where the call does. `args(schema, i, tool)`: [the Lark
    expression of the arguments, rules it names] (default: JSON as `tojson` writes it).

    The builder: (tools, name, text, token, think) -> the Lark grammar of a reply: free text (or `text`, a Lark
    expression) or calls, after `opening(name)` when `name` is given ("" forces some call). `tools`: name ->
    {"schema": the arguments' JSON schema} or a custom tool's `format` (grammar or regex); `token(marker)`: the
    marker as a Lark token (`<[id]>`), None to write it as text. `think` (the template has a reasoning channel):
    a free reply may start with a reasoning block as Qwen3's template writes it, `<think>` ... `</think>` then
    "\n\n" (markers as tokens where they are one: llguidance keeps any added token out of a regex, so TEXT could
    not hold them), its opening optional since some templates write it in the prompt (Qwen3-2507 thinking). Each
    tool's piece is compiled on its own first, so that a refusal names the tool (`tools[name]`)."""
    # a reasoning block's markers are markers too
    markers = (*markers, "<think>", "</think>")
    split = re.compile("(" + "|".join(map(re.escape, markers)) + ")")

    def build(
        tools: dict[str, dict[str, Any]],
        name: str | None,
        text: str | None,
        token: Callable[[str], str | None],
        think: bool = False,
    ) -> str:
        def lark(*pieces: Any) -> str:
            out = []
            for p in pieces:
                if isinstance(p, re.Pattern):
                    out.append(f"/{p.pattern}/")
                else:
                    out += [s in markers and token(s) or json.dumps(s) for s in split.split(p) if s]
            return " ".join(out)

        head, rules = opening(None), []
        for i, (tool, spec) in enumerate(tools.items()):
            if "schema" in spec:
                first, *rest = args(spec["schema"], i, tool)
                mine = [f"args{i}: {first} {lark(*close)}", *rest]
            else:
                mine = [*_inline(tool, i, spec, close[0], raw), f"args{i}: T{i} {lark(*close[1:])}"]
            rules += [*mine, f"call{i}: {lark(opening(tool)[len(head) :])} args{i}"]
            check_grammar("\n".join([f"start: args{i}", *mine]), f"tools[{tool}]")  # a 400 naming the tool
        calls = f"call ({lark(*sep)} call)* {lark(*end)}" if sep else f"call {lark(*end)}"
        if name:
            start = f"args{list(tools).index(name)} {lark(*end)}"
        elif name == "":
            start = calls
        else:
            free = f"{text} | " if text else f"TEXT | {'PROSE? ' * bool(prose)}"
            start = f"{'think? ' * think}({free}{lark(head)} {calls})"
        return "\n".join(
            [
                f"start: {start}",
                f"call: {' | '.join(f'call{i}' for i in range(len(tools)))}",
                *rules,
                f"TEXT: /(?s:.*)/ & ~/{avoid}/",
                *([f"PROSE: /{prose}/ & ~/{avoid}/"] if prose else []),
                *[
                    "think: " + lark("<think>") + "? THINK " + lark("</think>\n\n"),  # see the docstring
                    "THINK: /(?s:.*)/ & ~/(?s:.*)<\\/think>(?s:.*)/",
                ]
                * (think and name is None),
            ]
        )

    return build


def _hermes_read(match: re.Match, tools: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    found = _RAW.fullmatch(match.group(1))
    # a grammar tool's raw input: the string it is (a template prints a string verbatim)
    if found and "schema" not in tools.get(found[1], _JSON):
        return [tool_call(new_call_id(), found[1], found[2], raw=True)]
    return [_json_call(json.loads(match.group(1)))]


_TAGS, _JSON = ("<tool_call>", "</tool_call>"), {"schema": {}}
_TAG_CALLS = {
    "close": ("}\n", "</tool_call>"),
    "sep": ("\n<tool_call>\n",),
    "avoid": "(?s:.*)<tool_call>(?s:.*)",
}
# the opening: the exact prefix Qwen/Hermes templates render before a call (`{"name": ..., "arguments": ...}`);
# the text before calls ends with a newline after its last non-space (templates write it rstripped, then "\n")
_format(
    "hermes",
    _HERMES,
    _hermes_read,
    "<tool_call>",
    lambda name: "<tool_call>\n" + (f'{{"name": {json.dumps(name)}, "arguments": ' if name else ""),
    _TAGS,
    grammar={**_TAG_CALLS, "prose": r"(?s:.*)\S\n", "raw": True},
)

_XML_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
# Python's values as the template's `string` writes them, and as a grammar of the types
_PY, _PY_LARK = (
    {"True": True, "False": False, "None": None},
    {"boolean": '"True" | "False"', "null": '"None"'},
)
# a text value with the block's close: one terminal, so that llguidance's greedy lexer ends it there (`_inline`)
_XML_TEXT = r"/(?s:.*)\n<\/parameter>\n/ & ~/(?s:.*)<\/parameter>(?s:.*)<\/parameter>(?s:.*)/"


def _text(schema: Any) -> list[str] | None:
    """The choices of a value the template writes as it is and the parser keeps as text, a string ([]: any);
    None for any other value."""
    choices = (
        schema.get("enum", [schema["const"]] if "const" in schema else [])
        if isinstance(schema, dict)
        else [0]
    )
    return (
        choices
        if all(isinstance(c, str) for c in choices) and (choices or schema.get("type") == "string")
        else None
    )


def _xml_value(raw: str, schema: Any = None) -> Any:
    """A parameter's value. By its property's schema where the tool is known: text for a string, else Python's
    True/False/None or JSON as the template writes them. Untyped, typed where the type renders back to the same
    text (objects and lists as JSON, other values with `string`): "42" -> 42, but "true" stays "true"."""
    with suppress(ValueError):
        value = (
            raw
            if _text(schema) is not None
            else _PY[raw]
            if schema is not None and raw in _PY
            else json.loads(raw)
        )
        return (
            value
            if schema is not None
            or (json.dumps(value, ensure_ascii=False) if isinstance(value, dict | list) else str(value))
            == raw
            else raw
        )
    return raw


def _xml_args(schema: dict[str, Any], i: int, tool: str) -> list[str]:
    """qwen3_coder's arguments as the template writes them and `_xml_value` reads them back: a block per property
    in the schema's order (the required ones present), a string as text (its choices as literals), a boolean or
    null as Python writes it, anything else as JSON (`tojson`, the schema's `$defs` kept); without properties,
    any blocks of text. A string's pattern, format or length cannot hold on plain text: a 400 naming the tool."""
    blocks = [] if schema.get("properties") else [f'("<parameter=" /[^>\\n]+/ ">\\n" T{i})*']
    defs = {k: v for k, v in schema.items() if k in ("$defs", "definitions")}  # what its properties refer to
    for name, sub in (schema.get("properties") or {}).items():
        # a boolean schema: `true` takes any value (here `false` too)
        sub = sub if isinstance(sub, dict) else {}
        choices = _text(sub)
        if choices is not None and {"pattern", "format", "minLength", "maxLength"} & sub.keys():
            raise ValueError(
                f"tools[{tool}]: {name!r}: qwen3_coder's strings are plain text: no pattern, format or length"
            )
        value = (
            (" | ".join(json.dumps(f"{c}\n</parameter>\n") for c in choices) or f"T{i}")
            if choices is not None
            else f'({_PY_LARK.get(sub.get("type")) or json_lark({**sub, **defs}, JSON_STYLE)}) "\\n</parameter>\\n"'
        )
        blocks.append(
            f'({json.dumps(f"<parameter={name}>")} "\\n" ({value})){"?" * (name not in schema.get("required", []))}'
        )
    return [" ".join(blocks), f"T{i}: {_XML_TEXT}"]


def _xml_read(m: re.Match, tools: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    name = m.group(1).strip()
    props = tools.get(name, _JSON).get("schema", {}).get("properties") or {}
    return [
        tool_call(new_call_id(), name, {k: _xml_value(v, props.get(k)) for k, v in _XML_PARAM.findall(m[2])})
    ]


# the text before calls ends in a non-space and "\n\n" (the template writes it trimmed, "\n", then "\n<tool_call>")
_format(
    "qwen3_coder",
    _XML_CALL,
    _xml_read,
    "<tool_call>",
    lambda name: "<tool_call>\n" + (f"<function={name}>\n" if name else ""),
    _TAGS,
    grammar={
        **_TAG_CALLS,
        "close": ("</function>\n</tool_call>",),
        "prose": r"(?s:.*)\S\n\n",
        "args": _xml_args,
    },
)

# a call is the whole reply, one JSON object (the template renders one call a turn), after an optional python tag
_format(
    "llama3_json",
    re.compile(r"\A\s*(?:<\|python_tag\|>)?\s*(\{.*\})\s*\Z", re.DOTALL),
    lambda m, _: [_json_call(json.loads(m.group(1)))],
    r"\A\s*(?:<\|python_tag\|>)?\s*\{",
    lambda name: '{"name": "' + (f'{name}", "parameters": ' if name else ""),
    ("<|python_tag|>",),
    grammar={"close": ("}",), "sep": None, "avoid": r"\s*\{(?s:.*)"},
)


# `[TOOL_CALLS]` then a JSON list of calls (v3, Nemo), or name[ARGS]{...} per call, [CALL_ID]id between (v11+)
_MISTRAL = re.compile(
    r"\[TOOL_CALLS\]\s*(?:(\[.*?\])|([^\[\]{}\s]+)(?:\[CALL_ID\](\w+))?\[ARGS\](\{.*?\}))"
    r"(?=\s*(?:\[TOOL_CALLS\]|$))",
    re.DOTALL,
)


def _mistral_read(m: re.Match, _: Any = None) -> list[dict[str, Any]]:
    """Mistral's templates write call ids back (and refuse any but 9 alphanumerics): the model's own are kept."""
    if m.group(1):
        return [_json_call(obj, str(obj.get("id") or new_call_id("", 9))) for obj in json.loads(m.group(1))]
    return [tool_call(m.group(3) or new_call_id("", 9), m.group(2), json.loads(m.group(4)))]


_MISTRAL_MARKERS = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
_CALLS = {"avoid": r"(?s:.*)\[TOOL_CALLS\](?s:.*)"}  # free text never holds a call opening
_format(
    "mistral",
    _MISTRAL,
    _mistral_read,
    r"\[TOOL_CALLS\]",
    lambda name: "[TOOL_CALLS][" + (f'{{"name": {json.dumps(name)}, "arguments": ' if name else ""),
    _MISTRAL_MARKERS,
    strip=False,
    grammar={
        **_CALLS,
        "close": (', "id": "', re.compile("[A-Za-z0-9]{9}"), '"}'),
        "sep": (", ",),
        "end": ("]",),
    },
)
_format(
    "mistral_v11",
    _MISTRAL,
    _mistral_read,
    r"\[TOOL_CALLS\]",
    lambda name: "[TOOL_CALLS]" + (f"{name}[ARGS]" if name else ""),
    _MISTRAL_MARKERS,
    strip=False,
    grammar={**_CALLS, "close": (), "sep": ("[TOOL_CALLS]",), "prose": "(?s:.*)"},
)

# auto: (what a chat template's text holds, the parser of its call format), the first match; none -> hermes
_FORMATS = (
    (("<tool_call>", "<function="), "qwen3_coder"),
    (("<tool_call>",), "hermes"),
    (("[ARGS]",), "mistral_v11"),
    (("[TOOL_CALLS]",), "mistral"),
    (("<|python_tag|>",), "llama3_json"),
    (('"parameters"', "ipython"), "llama3_json"),
)


def choose_tool_parser(name: str, template: str, tokenizer: Any = None) -> ToolParser:
    """The parser `name`; for "auto" the model's own (a tokenizer with a `response_template` for tool calls),
    else the one whose format the chat template writes (docs/internals.md)."""
    if name != "auto":
        return get_tool_parser(name)
    family = get_tool_parser(
        next((p for marks, p in _FORMATS if all(m in template for m in marks)), "hermes")
    )
    spec = (getattr(tokenizer, "response_template", None) or {}).get("fields", {}).get("tool_calls")
    if spec is None:
        return family

    def own(text: str, tools: dict[str, dict[str, Any]] | None = None) -> Parsed:
        if any("schema" not in s for s in (tools or {}).values()):  # grammar tools: the reply follows the
            return family(text, tools)  # family's grammar, so the family's parser reads it
        try:
            calls = [
                tool_call(new_call_id(), c["function"]["name"], c["function"].get("arguments", {}))
                for c in tokenizer.parse_response(text, prefix="").get("tool_calls") or []
            ]
        except _BAD:  # a call it cannot read: the template format's parser keeps it as text and counts it
            return family(text, tools)
        # the content: the reply before its first call, as generated (`open`: a literal or a list of them)
        opens = [spec["open"]] if isinstance(spec.get("open"), str) else spec.get("open") or []
        first = re.search(spec.get("open_pattern") or "|".join(map(re.escape, opens)), text, re.DOTALL)
        return Parsed(text[: first.start()].rstrip() if first else text, calls) if calls else Parsed(text)

    own.opening, own.markers, own.grammar = family.opening, family.markers, family.grammar  # type: ignore[attr-defined]
    return own
