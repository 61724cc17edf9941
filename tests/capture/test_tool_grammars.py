"""Tool calls under the reply grammar (`tools.call_grammar`, `Session._constrain`) on the real embedded engine
with the tiny random model at T=1: unconstrained it writes garbage, so replies whose calls parse and whose inputs
match their grammar or schema over several seeds show the constraint. Through the official `openai` and
`anthropic` SDKs; every family whose call format has a grammar, with its published template (test_tool_formats.py)."""

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from openai import AsyncOpenAI
from test_tool_formats import FAMILIES, TEMPLATES, family_tokenizer

from molt.capture.tools import get_tool_parser
from molt.testing import models
from molt.testing.models import build_tokenizer
from molt.testing.scripted import RecordingEngine, ScriptedEngine, live_capture_server
from molt.types import FinishReason

SEEDS = range(4)
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"enum": ["x", "y"]}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
CODE = {
    "type": "grammar",
    "syntax": "lark",  # as Codex's exec: an optional pragma line, then a short source
    "definition": 'start: p | S\np: P "\\n" S\nP: /#[a-z]{0,4}/\nS: /[a-z0-9();= ]{1,12}/',
}


def api(session):
    return AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)


async def test_responses_forced_calls_follow_the_custom_grammar_and_the_strict_schema(hf_engine, tokenizer):
    engine = RecordingEngine(hf_engine)
    custom, strict = (
        {"type": "custom", "name": "exec", "format": CODE},
        {"type": "function", "name": "add", "parameters": ADD},
    )  # strict: the default
    async with live_capture_server(engine, tokenizer) as server:
        client = api(await server.open_session())
        for _ in SEEDS:
            for tools, choice in (
                ([custom], {"type": "custom", "name": "exec"}),
                ([custom], "required"),
                ([strict], {"type": "function", "name": "add"}),
                ([strict], "required"),
            ):
                reply = await client.responses.create(
                    model="m",
                    input="Go.",
                    tools=tools,
                    tool_choice=choice,
                    max_output_tokens=80,
                    temperature=1.0,
                )
                calls = [o for o in reply.output if o.type in ("custom_tool_call", "function_call")]
                c = engine.records[-1][2]
                assert reply.status == "completed" and calls, (
                    choice,
                    c.finish_reason,
                    c.token_ids,
                    reply.output[0].content[0].text if reply.output[0].type == "message" else reply.output,
                )
                for call in calls:
                    if call.type == "custom_tool_call":
                        assert re.fullmatch(r"(#[a-z]{0,4}\n)?[a-z0-9();= ]{1,12}", call.input), call.input
                    else:
                        jsonschema.validate(json.loads(call.arguments), ADD)


async def test_chat_completions_strict_tools_auto_and_forced(hf_engine, tokenizer):
    """Strict function tools over Chat Completions: a forced call's arguments follow the schema; in auto mode a
    reply is text without a call opening or calls that follow it (a random model's text never parses as a call)."""
    engine = RecordingEngine(hf_engine)
    tools = [{"type": "function", "function": {"name": "add", "parameters": ADD, "strict": True}}]
    async with live_capture_server(engine, tokenizer) as server:
        client = api(await server.open_session())
        for seed in SEEDS:
            for choice in ({"type": "function", "function": {"name": "add"}}, "auto"):
                reply = await client.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": "Add."}],
                    tools=tools,
                    tool_choice=choice,
                    max_tokens=60,
                    seed=seed,
                )
                message = reply.choices[0].message
                for call in message.tool_calls or []:
                    jsonschema.validate(json.loads(call.function.arguments), ADD)
                assert message.tool_calls or choice == "auto"
                assert "<tool_call>" not in (message.content or "")  # never a malformed call


@pytest.fixture(
    scope="module",
    params=["qwen3.jinja", "qwen3_coder.jinja", "llama3.2.jinja", "mistral_nemo.jinja", "ministral3.jinja"],
)
def family(request, tmp_path_factory):
    """(template, its tokenizer, an embedded engine on a tiny random model of that tokenizer's vocabulary)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from molt.engine.hf import HFEngine
    from molt.testing.models import _save

    tok = family_tokenizer(request.param)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        ),
        dtype=torch.float32,
    )
    engine = HFEngine(str(_save(model, tok, tmp_path_factory.mktemp("family"))))
    yield request.param, tok, engine
    asyncio.run(engine.close())


async def test_strict_calls_in_each_familys_format(family):
    """Every family whose format has a grammar (hermes, qwen3_coder, llama3_json, mistral, mistral_v11): a strict
    tool forced (by name, required) and auto, at T=1 over several seeds, over Chat Completions and over Responses
    (strict left out: the Responses default, as the Agents SDK sends it), gives calls whose arguments follow the
    schema (a forced reply, calls unless the token limit cut it), and no malformed call but one the token limit
    cut; a call sent back renders to the tokens sampled (one segment)."""
    name, tok, hf = family
    engine = RecordingEngine(hf)
    tools = [{"type": "function", "function": {"name": "add", "parameters": ADD, "strict": True}}]
    async with live_capture_server(engine, tok) as server:
        assert server.parser is get_tool_parser(FAMILIES[name][0])
        session = await server.open_session()
        client, calls = api(session), 0
        for seed in SEEDS:
            for choice in ({"type": "function", "function": {"name": "add"}}, "required", "auto"):
                reply = await client.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": "Add."}],
                    tools=tools,
                    tool_choice=choice,
                    max_tokens=60,
                    seed=seed,
                    temperature=1.0,
                )
                message = reply.choices[0].message
                assert message.tool_calls or choice == "auto" or reply.choices[0].finish_reason == "length"
                for call in message.tool_calls or []:
                    jsonschema.validate(json.loads(call.function.arguments), ADD)
                calls += len(message.tool_calls or [])
            for choice in ("required", "auto"):
                reply = await client.responses.create(
                    model="m",
                    input="Add.",
                    tools=[{"type": "function", "name": "add", "parameters": ADD}],
                    tool_choice=choice,
                    max_output_tokens=60,
                    temperature=1.0,
                )
                found = [o for o in reply.output if o.type == "function_call"]
                assert found or choice == "auto" or reply.status == "incomplete"
                for call in found:
                    jsonschema.validate(json.loads(call.arguments), ADD)
        # a forced call, resent with its result, renders back to the sampled tokens: one segment
        session2 = await server.open_session()
        messages = [{"role": "user", "content": "Add."}]
        first = await api(session2).chat.completions.create(
            model="m",
            messages=messages,
            tools=tools,
            tool_choice={"type": "function", "function": {"name": "add"}},
            max_tokens=60,
            seed=0,
            temperature=1.0,
        )
        messages += [
            first.choices[0].message,
            {"role": "tool", "tool_call_id": first.choices[0].message.tool_calls[0].id, "content": "7"},
        ]
        await api(session2).chat.completions.create(model="m", messages=messages, tools=tools, max_tokens=5)
        # (Qwen3's template writes an empty think block into the last reply only: a reply without one, a rewrite)
        assert len(await session2.close()) == 1 + (name == "qwen3.jinja")
        # a reply the token limit cut in a call is the only malformed one
        cut = sum(c.finish_reason is FinishReason.LENGTH for *_, c in engine.records)
        assert session.stats["malformed_tool_calls"] <= cut and session.stats["tool_calls"] >= calls >= len(
            SEEDS
        )


async def test_anthropic_strict_tools(hf_engine, tokenizer):
    """Anthropic strict tool use (`strict: true`) through the official `anthropic` SDK: a forced call (`tool`,
    `any`) gives a tool_use block whose input follows input_schema; in auto mode a reply is text or such calls."""
    from anthropic import AsyncAnthropic

    engine = RecordingEngine(hf_engine)
    tools = [{"name": "add", "description": "Add.", "input_schema": ADD, "strict": True}]
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session()
        client, used = AsyncAnthropic(base_url=session.session_url, api_key=session.api_key, max_retries=0), 0
        for _ in SEEDS:
            for choice in ({"type": "tool", "name": "add"}, {"type": "any"}, {"type": "auto"}):
                reply = await client.messages.create(
                    model="m",
                    max_tokens=60,
                    tools=tools,  # T=1: the default
                    tool_choice=choice,
                    messages=[{"role": "user", "content": "Add."}],
                )
                uses = [b for b in reply.content if b.type == "tool_use"]
                assert uses or choice["type"] == "auto" or reply.stop_reason == "max_tokens"
                for use in uses:
                    jsonschema.validate(use.input, ADD)
                used += len(uses)
        assert used >= len(SEEDS)


# every kind of value a Qwen3-Coder call holds: text (digits and JSON-looking text too), choices, Python's
# booleans and None, numbers, JSON objects and lists; optional properties may be left out
TYPED = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "mode": {"enum": ["r", "w"]},
        "n": {"type": "integer"},
        "x": {"type": "number"},
        "ok": {"type": "boolean"},
        "none": {"type": "null"},
        "opts": {
            "type": "object",
            "properties": {"k": {"type": "string"}},
            "required": ["k"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string"}},
        "note": {"type": "string"},
    },
    "required": ["path", "mode", "n"],
}
TYPED_CALLS = [
    {
        "path": "42",
        "mode": "w",
        "n": -3,
        "x": 2.5,
        "ok": False,
        "none": None,
        "opts": {"k": "v"},
        "tags": ["a", "b"],
        "note": '{"a": 1}\nline 2',
    },
    {"path": "a b", "mode": "r", "n": 0, "ok": True},
]


@pytest.mark.parametrize("arguments", TYPED_CALLS)
def test_qwen3_coder_grammar_holds_the_templates_calls_and_the_parser_reads_them_back_by_schema(arguments):
    """A call as Qwen3-Coder's template writes it (values with `string`, objects and lists with `tojson`) is in the
    reply grammar built from the tool's schema, and the parser, knowing the schema, reads back the arguments sent
    (the string "42" stays a string, False a boolean), so that resent it renders the same text; without the
    schema, a value is typed by how it reads."""
    from llguidance import LLMatcher
    from llguidance.hf import from_tokenizer

    from molt.types import check_grammar

    tok = family_tokenizer("qwen3_coder.jinja")
    call = {"type": "function", "function": {"name": "f", "arguments": arguments}}
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Go."}], tokenize=False, add_generation_prompt=True
    )
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Go."}, {"role": "assistant", "content": "", "tool_calls": [call]}],
        tokenize=False,
    )[len(prompt) :].removesuffix("<|im_end|>\n")
    parser = get_tool_parser("qwen3_coder")
    token = lambda m: f"<[{ids[0]}]>" if len(ids := tok.encode(m, add_special_tokens=False)) == 1 else None
    grammar = check_grammar(parser.grammar({"f": {"schema": TYPED}}, None, None, token))
    matcher = LLMatcher(from_tokenizer(tok), grammar)
    assert matcher.consume_tokens(tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]), text
    (read,) = parser(text, tools={"f": {"schema": TYPED}}).calls
    assert read["function"]["arguments"] == arguments
    untyped = parser(text).calls[0]["function"][
        "arguments"
    ]  # without the schema, values are typed by how they read
    assert untyped["path"] == (42 if arguments["path"] == "42" else "a b") and untyped["ok"] in (
        "False",
        "True",
    )


async def test_qwen3_coder_strict_tools_on_every_wire():
    """On qwen3_coder, `strict: true` (Chat Completions, Responses, Anthropic) and Responses' default are held to
    the schema by the reply grammar; a tool that is not strict is read by its schema too (a string of digits stays
    a string)."""
    import anthropic

    tok = family_tokenizer("qwen3_coder.jinja")
    call = "<tool_call>\n<function=add>\n<parameter=a>\n3\n</parameter>\n<parameter=b>\nx\n</parameter>\n</function>\n</tool_call>"
    engine = ScriptedEngine(tok, [call] * 4, max_model_len=8192)
    loose = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    async with live_capture_server(engine, tok) as server:
        assert server.parser is get_tool_parser("qwen3_coder")
        session = await server.open_session()
        client = api(session)
        reply = await client.responses.create(
            model="m",
            input="Add.",
            tools=[{"type": "function", "name": "add", "parameters": ADD}],
            tool_choice="required",
        )
        (item,) = [o for o in reply.output if o.type == "function_call"]
        assert (
            json.loads(item.arguments) == {"a": 3, "b": "x"}
            and "<parameter=a>" in engine.calls[-1]["params"].grammar
        )
        reply = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Add."}],
            tools=[{"type": "function", "function": {"name": "add", "parameters": ADD, "strict": True}}],
        )
        assert json.loads(reply.choices[0].message.tool_calls[0].function.arguments) == {"a": 3, "b": "x"}
        assert "%json" in engine.calls[-1]["params"].grammar
        use = await anthropic.AsyncAnthropic(
            base_url=session.session_url, api_key=session.api_key, max_retries=0
        ).messages.create(
            model="m",
            max_tokens=200,
            messages=[{"role": "user", "content": "Add."}],
            tools=[{"name": "add", "input_schema": ADD, "strict": True}],
        )
        assert [b.input for b in use.content if b.type == "tool_use"] == [{"a": 3, "b": "x"}]
        assert engine.calls[-1]["params"].grammar is not None
        engine.replies = [call.replace("\nx\n", "\n7\n")]
        reply = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Add."}],
            tools=[{"type": "function", "function": {"name": "add", "parameters": loose}}],
        )
        assert json.loads(reply.choices[0].message.tool_calls[0].function.arguments) == {"a": 3, "b": "7"}
        assert engine.calls[-1]["params"].grammar is None
        with pytest.raises(
            openai.BadRequestError, match=r"tools\[add\]: 'b': qwen3_coder's strings are plain text"
        ):
            await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "Add."}],
                tools=[
                    {
                        "type": "function",
                        "function": {
                            "name": "add",
                            "strict": True,
                            "parameters": {
                                **loose,
                                "properties": {"b": {"type": "string", "pattern": "^[a-z]+$"}},
                            },
                        },
                    }
                ],
            )


async def test_markers_that_are_not_one_token_are_text_in_the_grammar():
    """A tokenizer without the format's markers as tokens (SmolLM2 has no `<tool_call>` token; here Mistral's
    `[TOOL_CALLS]`/`[ARGS]` on the Llama family's tokenizer): strict calls are still constrained, the markers
    written as text in the grammar, which accepts the call as the model writes it in any tokenization."""
    from llguidance import LLMatcher
    from llguidance.hf import from_tokenizer

    from molt.testing.scripted import ScriptedEngine

    tok = family_tokenizer("llama3.2.jinja")
    assert len(tok.encode("[TOOL_CALLS]", add_special_tokens=False)) > 1
    engine = ScriptedEngine(tok, ['a[ARGS]{"a": 3, "b": "x"}'], max_model_len=8192)
    async with live_capture_server(engine, tok, tool_parser="mistral_v11") as server:
        reply = await api(await server.open_session()).chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Add."}],
            tool_choice="required",
            tools=[{"type": "function", "function": {"name": "a", "parameters": ADD, "strict": True}}],
        )
    (call,) = reply.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"a": 3, "b": "x"}
    grammar = engine.calls[0]["params"].grammar
    assert '"[ARGS]"' in grammar and "<[" not in grammar
    matcher = LLMatcher(from_tokenizer(tok), grammar)
    assert matcher.consume_tokens(
        tok.encode('a[ARGS]{"a": 3, "b": "x"}', add_special_tokens=False) + [tok.eos_token_id]
    )
    assert not matcher.is_error()


async def test_grammar_tools_need_a_format_that_holds_raw_input():
    """A custom grammar tool's raw input sits verbatim in a Hermes call; Llama's format (JSON arguments, quoted
    by its template) cannot hold it: a 400 naming the tool, nothing generated."""
    import openai

    from molt.testing.scripted import ScriptedEngine

    tok = family_tokenizer("llama3.2.jinja")
    engine = ScriptedEngine(tok, ["ok"], max_model_len=8192)
    async with live_capture_server(engine, tok) as server:
        with pytest.raises(openai.BadRequestError, match=r"tools\[exec\]: its input is raw text"):
            await api(await server.open_session()).responses.create(
                model="m", input="Go.", tools=[{"type": "custom", "name": "exec", "format": CODE}]
            )
    assert not engine.calls


# Codex CLI's `apply_patch` freeform tool (the Lark grammar in @openai/codex 0.171's binary; sent for its catalog's
# models with apply_patch_tool_type "freeform", e.g. `codex exec -m gpt-5.5`)
APPLY_PATCH = r"""start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?
filename: /(.+)/
add_line: "+" /(.*)/ LF -> line
change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF
%import common.LF
"""
PATCH = "*** Begin Patch\n*** Update File: a.py\n@@ def f():\n-    return 1\n+    return 2\n*** End Patch\n"


def custom(name, syntax, definition):
    return {
        "type": "custom",
        "name": name,
        "format": {"type": "grammar", "syntax": syntax, "definition": definition},
    }


def raw_call(name, raw):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {raw}}}\n</tool_call>'


def accepts(tok, grammar, text):
    """Whether a fresh llguidance matcher takes `text` (as the tokenizer writes it) then EOS, and ends complete."""
    from llguidance import LLMatcher
    from llguidance.hf import from_tokenizer

    matcher = LLMatcher(from_tokenizer(tok, n_vocab=len(tok), eos_token=tok.eos_token_id), grammar)
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    return all(matcher.consume_token(t) for t in ids) and matcher.is_stopped() and not matcher.is_error()


@pytest.mark.parametrize(
    "definition, good, bad",
    [
        (APPLY_PATCH, PATCH, PATCH.replace("*** End Patch\n", "")),
        ('start: "select"i " " NAME\nNAME: /[a-z]+/', "SeLeCt ab", "SeLeCt AB"),
        ('start: LF WS? "x"\n%import common (LF, WS)', "\n \tx", " x"),
    ],
    ids=["codex_apply_patch", "ci_string", "imports"],
)
async def test_lark_grammar_tools_keep_their_meaning(definition, good, bad):
    """Valid Lark grammars (Codex's apply_patch: `%import common.LF`, a `-> line` alias; a string's `i` flag; the
    list form of %import) are inlined as terminals with the language they had: the reply grammar takes a call
    with valid input token by token and refuses one with invalid input, and the input comes back as written."""
    tok = build_tokenizer()
    engine = ScriptedEngine(tok, [raw_call("apply_patch", good)], max_model_len=8192)
    async with live_capture_server(engine, tok) as server:
        reply = await api(await server.open_session()).responses.create(
            model="m", input="Patch it.", tools=[custom("apply_patch", "lark", definition)]
        )
    assert [o.input for o in reply.output if o.type == "custom_tool_call"] == [good]
    grammar = engine.calls[0]["params"].grammar
    assert accepts(tok, grammar, raw_call("apply_patch", good)) and not accepts(
        tok, grammar, raw_call("apply_patch", bad)
    )


async def test_grammar_tools_that_cannot_be_inlined_are_named():
    """A grammar llguidance refuses as sent (a terminal priority), or that cannot keep its meaning once its input is
    one terminal (`%ignore`), is a 400 that names the tool; nothing is generated."""
    tok = build_tokenizer()
    engine = ScriptedEngine(tok, ["x"], max_model_len=8192)
    async with live_capture_server(engine, tok) as server:
        client = api(await server.open_session())
        for definition, why in (
            ("start: A | B\nA.2: /a+/\nB: /[ab]+/", r"tools\[calc\]: "),
            ('%ignore " "\nstart: "a" "b"', r"tools\[calc\]: %ignore is not supported"),
        ):
            with pytest.raises(openai.BadRequestError, match=why) as e:
                await client.responses.create(
                    model="m", input="x", tools=[custom("calc", "lark", definition)]
                )
            assert e.value.status_code == 400
    assert not engine.calls


@pytest.mark.parametrize(
    "regex, raw", [(r"\d+\.\d+", "1.50"), (r'"[a-z]+"', '"abc"'), (r"\{.*\}", '{"a":1}'), ("x?", "")]
)
async def test_grammar_tool_input_is_returned_and_resent_as_written(regex, raw):
    """A grammar tool's raw input that happens to be JSON (or is empty) is not decoded: it comes back as the model
    wrote it, and the `custom_tool_call` resent renders back to the tokens sampled (one segment)."""
    tok = build_tokenizer()
    tools = [custom("price", "regex", regex)]
    async with live_capture_server(ScriptedEngine(tok, [raw_call("price", raw), "Done."]), tok) as server:
        session = await server.open_session()
        client = api(session)
        first = await client.responses.create(model="m", input="Price?", tools=tools)
        (call,) = [o for o in first.output if o.type == "custom_tool_call"]
        assert call.input == raw
        output = {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "ok"}
        await client.responses.create(
            model="m",
            tools=tools,
            input=[{"role": "user", "content": "Price?"}, call.model_dump(exclude_none=True), output],
        )
        assert len(await session.close()) == 1


@pytest.mark.parametrize("wire", ["chat_required", "responses_default_strict"])
async def test_tool_requests_work_without_a_single_token_call_marker(monkeypatch, wire):
    """On a tokenizer without a `<tool_call>` token (SmolLM2-135M-Instruct's), a forced call and a Responses
    function tool (strict by default) are constrained with the marker written as text."""
    monkeypatch.setattr(models, "MARKER_TOKENS", [])
    tok = build_tokenizer()
    assert len(tok.encode("<tool_call>", add_special_tokens=False)) > 1
    reply = raw_call("add", '{"a": 1, "b": "x"}')
    engine = ScriptedEngine(tok, [reply[len("<tool_call>\n") :] if wire == "chat_required" else reply])
    async with live_capture_server(engine, tok) as server:
        client = api(await server.open_session())
        if wire == "chat_required":  # the opening is forced: the model continues after it
            r = await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "Add."}],
                tool_choice="required",
                tools=[{"type": "function", "function": {"name": "add", "parameters": ADD}}],
            )
            assert [json.loads(c.function.arguments) for c in r.choices[0].message.tool_calls] == [
                {"a": 1, "b": "x"}
            ]
        else:
            r = await client.responses.create(
                model="m", input="Add.", tools=[{"type": "function", "name": "add", "parameters": ADD}]
            )
            assert [o.type for o in r.output] == ["function_call"]
            assert accepts(tok, engine.calls[0]["params"].grammar, reply)
    assert "<[" not in engine.calls[0]["params"].grammar


QWEN3_THINKING = [
    '<think>\nI need the calculator.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "x"}}\n</tool_call>',
    "<think>\nNothing to call.\n</think>\n\nHello.",
    "<think>\nhm\n</think>\n\nLet me add.\n" + raw_call("add", '{"a": 2, "b": "y"}'),
    "\nhm\n</think>\n\nHello.",
]  # the last: a template that opens the block in the prompt (Qwen3-2507)


@pytest.mark.parametrize(
    "reply",
    QWEN3_THINKING,
    ids=["think_then_call", "think_then_text", "think_prose_call", "opened_in_prompt"],
)
async def test_qwen3_thinking_replies_fit_the_reply_grammar(reply):
    """Qwen3's template has a reasoning channel: the reply grammar allows a `<think>` ... `</think>` block (the
    markers as tokens, which llguidance keeps out of any regex), then the template's "\\n\\n", before text or
    calls; the matcher takes each reply as the tokenizer writes it, and a block elsewhere is refused."""
    tok = family_tokenizer("qwen3.jinja")  # <think> an added token, as in Qwen3's vocabulary
    engine = ScriptedEngine(tok, [reply], max_model_len=8192)
    async with live_capture_server(engine, tok) as server:
        r = await api(await server.open_session()).chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Add."}],
            tools=[{"type": "function", "function": {"name": "add", "parameters": ADD, "strict": True}}],
        )
    grammar = engine.calls[0]["params"].grammar
    assert accepts(tok, grammar, reply) and not accepts(tok, grammar, "Hello.<think>\nhm\n</think>\n\n")
    assert r.choices[0].message.content.startswith("<think>" if reply.startswith("<") else "\nhm")


async def test_qwen3_thinking_sampled_replies_parse(tmp_path):
    """At T=1 a random model under the Qwen3 reply grammar writes replies that parse: calls that follow the schema
    (none malformed), or text without a call opening."""
    from transformers import AutoTokenizer

    from molt.engine.hf import HFEngine
    from molt.testing.models import build_tiny_llama

    path = build_tiny_llama(tmp_path, template=(TEMPLATES / "qwen3.jinja").read_text(), max_positions=2048)
    engine = HFEngine(str(path))
    tools = [{"type": "function", "function": {"name": "add", "parameters": ADD, "strict": True}}]
    try:
        async with live_capture_server(engine, AutoTokenizer.from_pretrained(path)) as server:
            session = await server.open_session()
            for seed in range(6):
                r = await api(session).chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": "Add."}],
                    tools=tools,
                    max_tokens=60,
                    temperature=1.0,
                    seed=seed,
                )
                for call in r.choices[0].message.tool_calls or []:
                    jsonschema.validate(json.loads(call.function.arguments), ADD)
                assert "<tool_call>" not in (r.choices[0].message.content or "")
            assert session.stats["malformed_tool_calls"] == 0
    finally:
        await engine.close()


async def test_min_tokens_with_a_forced_call(hf_engine, tokenizer):
    """`min_tokens` beside the grammar of a forced call (one the client never sent): honoured while the grammar
    allows anything but EOS, so the call is made and the reply ends (engine side: tests/engine/test_grammar.py)."""
    async with live_capture_server(hf_engine, tokenizer) as server:
        r = await api(await server.open_session()).chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Add."}],
            tool_choice="required",
            max_tokens=60,
            tools=[{"type": "function", "function": {"name": "add", "parameters": ADD, "strict": True}}],
            extra_body={"min_tokens": 40},
            temperature=1.0,
            seed=1,
        )
    assert r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(r.choices[0].message.tool_calls[0].function.arguments), ADD)
