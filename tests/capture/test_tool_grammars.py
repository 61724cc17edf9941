"""Tool calls under the reply grammar (`tools.call_grammar`, `Session._constrain`) on the real embedded engine
with the tiny random model at T=1: unconstrained it writes garbage, so replies whose calls parse and whose inputs
match their grammar or schema over several seeds show the constraint. Through the official `openai` and
`anthropic` SDKs; every family whose call format has a grammar, with its published template (test_tool_formats.py)."""
import asyncio
import json
import re

import jsonschema
import pytest
from openai import AsyncOpenAI
from test_tool_formats import FAMILIES, family_tokenizer

from molt.capture.tools import get_tool_parser
from molt.testing.scripted import RecordingEngine, live_capture_server
from molt.types import FinishReason

SEEDS = range(4)
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"enum": ["x", "y"]}},
       "required": ["a", "b"], "additionalProperties": False}
CODE = {"type": "grammar", "syntax": "lark",  # as Codex's exec: an optional pragma line, then a short source
        "definition": 'start: p | S\np: P "\\n" S\nP: /#[a-z]{0,4}/\nS: /[a-z0-9();= ]{1,12}/'}


def api(session):
    return AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)


async def test_responses_forced_calls_follow_the_custom_grammar_and_the_strict_schema(hf_engine, tokenizer):
    engine = RecordingEngine(hf_engine)
    custom, strict = {"type": "custom", "name": "exec", "format": CODE}, {"type": "function", "name": "add",
                                                                           "parameters": ADD}  # strict: the default
    async with live_capture_server(engine, tokenizer) as server:
        client = api(await server.open_session())
        for _ in SEEDS:
            for tools, choice in (([custom], {"type": "custom", "name": "exec"}), ([custom], "required"),
                                  ([strict], {"type": "function", "name": "add"}), ([strict], "required")):
                reply = await client.responses.create(model="m", input="Go.", tools=tools, tool_choice=choice,
                                                      max_output_tokens=80, temperature=1.0)
                calls = [o for o in reply.output if o.type in ("custom_tool_call", "function_call")]
                c = engine.records[-1][2]
                assert reply.status == "completed" and calls, (choice, c.finish_reason, c.token_ids, reply.output[0].content[0].text if reply.output[0].type == "message" else reply.output)
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
                    model="m", messages=[{"role": "user", "content": "Add."}], tools=tools, tool_choice=choice,
                    max_tokens=60, seed=seed)
                message = reply.choices[0].message
                for call in message.tool_calls or []:
                    jsonschema.validate(json.loads(call.function.arguments), ADD)
                assert message.tool_calls or choice == "auto"
                assert "<tool_call>" not in (message.content or "")  # never a malformed call


@pytest.fixture(scope="module", params=["qwen3.jinja", "llama3.2.jinja", "mistral_nemo.jinja", "ministral3.jinja"])
def family(request, tmp_path_factory):
    """(template, its tokenizer, an embedded engine on a tiny random model of that tokenizer's vocabulary)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from molt.engine.hf import HFEngine
    from molt.testing.models import _save

    tok = family_tokenizer(request.param)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True), dtype=torch.float32)
    engine = HFEngine(str(_save(model, tok, tmp_path_factory.mktemp("family"))))
    yield request.param, tok, engine
    asyncio.run(engine.close())


async def test_strict_calls_in_each_familys_format(family):
    """Every family whose format has a grammar (hermes, llama3_json, mistral, mistral_v11): a strict tool forced
    (by name, required) and auto, at T=1 over several seeds, over Chat Completions and over Responses (strict left
    out: the Responses default, as the Agents SDK sends it), gives calls whose arguments follow the schema (a
    forced reply, calls unless the token limit cut it), and no malformed call but one the token limit cut;
    a call sent back renders to the tokens sampled (one segment)."""
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
                    model="m", messages=[{"role": "user", "content": "Add."}], tools=tools, tool_choice=choice,
                    max_tokens=60, seed=seed, temperature=1.0)
                message = reply.choices[0].message
                assert message.tool_calls or choice == "auto" or reply.choices[0].finish_reason == "length"
                for call in message.tool_calls or []:
                    jsonschema.validate(json.loads(call.function.arguments), ADD)
                calls += len(message.tool_calls or [])
            for choice in ("required", "auto"):
                reply = await client.responses.create(
                    model="m", input="Add.", tools=[{"type": "function", "name": "add", "parameters": ADD}],
                    tool_choice=choice, max_output_tokens=60, temperature=1.0)
                found = [o for o in reply.output if o.type == "function_call"]
                assert found or choice == "auto" or reply.status == "incomplete"
                for call in found:
                    jsonschema.validate(json.loads(call.arguments), ADD)
        # a forced call, resent with its result, renders back to the sampled tokens: one segment
        session2 = await server.open_session()
        messages = [{"role": "user", "content": "Add."}]
        first = await api(session2).chat.completions.create(
            model="m", messages=messages, tools=tools, tool_choice={"type": "function", "function": {"name": "add"}},
            max_tokens=60, seed=0, temperature=1.0)
        messages += [first.choices[0].message, {"role": "tool", "tool_call_id": first.choices[0].message.tool_calls[0].id,
                                                "content": "7"}]
        await api(session2).chat.completions.create(model="m", messages=messages, tools=tools, max_tokens=5)
        # (Qwen3's template writes an empty think block into the last reply only: a reply without one, a rewrite)
        assert len(await session2.close()) == 1 + (name == "qwen3.jinja")
        # a reply the token limit cut in a call is the only malformed one
        cut = sum(c.finish_reason is FinishReason.LENGTH for *_, c in engine.records)
        assert session.stats["malformed_tool_calls"] <= cut and session.stats["tool_calls"] >= calls >= len(SEEDS)


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
                reply = await client.messages.create(model="m", max_tokens=60, tools=tools,  # T=1: the default
                                                     tool_choice=choice, messages=[{"role": "user", "content": "Add."}])
                uses = [b for b in reply.content if b.type == "tool_use"]
                assert uses or choice["type"] == "auto" or reply.stop_reason == "max_tokens"
                for use in uses:
                    jsonschema.validate(use.input, ADD)
                used += len(uses)
        assert used >= len(SEEDS)


async def test_qwen3_coder_refuses_explicit_strict_and_degrades_implicit(tokenizer):
    """qwen3_coder's XML parameters have no grammar (docs/harnesses.md): an explicit `strict: true` (Chat
    Completions, Responses, Anthropic) is a 400 naming why, while a Responses function tool with `strict` left out
    (the Responses default, as the Agents SDK sends it) is offered unconstrained, as `strict: false` would be."""
    import anthropic
    import openai

    from molt.testing.scripted import ScriptedEngine

    tok = family_tokenizer("qwen3_coder.jinja")
    call = "<tool_call>\n<function=add>\n<parameter=a>\n3\n</parameter>\n<parameter=b>\nx\n</parameter>\n</function>\n</tool_call>"
    engine = ScriptedEngine(tok, [call], max_model_len=8192)
    async with live_capture_server(engine, tok) as server:
        assert server.parser is get_tool_parser("qwen3_coder")
        session = await server.open_session()
        client = api(session)
        reply = await client.responses.create(model="m", input="Add.", tools=[
            {"type": "function", "name": "add", "parameters": ADD}], tool_choice="required")
        (item,) = [o for o in reply.output if o.type == "function_call"]
        assert json.loads(item.arguments) == {"a": 3, "b": "x"} and engine.calls[-1]["params"].grammar is None
        with pytest.raises(openai.BadRequestError, match="grammar of the tool-call format"):
            await client.responses.create(model="m", input="Add.", tools=[
                {"type": "function", "name": "add", "parameters": ADD, "strict": True}])
        with pytest.raises(openai.BadRequestError, match="grammar of the tool-call format"):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Add."}], tools=[
                {"type": "function", "function": {"name": "add", "parameters": ADD, "strict": True}}])
        with pytest.raises(anthropic.BadRequestError, match="grammar of the tool-call format"):
            await anthropic.AsyncAnthropic(base_url=session.session_url, api_key=session.api_key, max_retries=0
                                           ).messages.create(model="m", max_tokens=20, messages=[
                                               {"role": "user", "content": "Add."}], tools=[
                                               {"name": "add", "input_schema": ADD, "strict": True}])
    assert len(engine.calls) == 1


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
            model="m", messages=[{"role": "user", "content": "Add."}], tool_choice="required", tools=[
                {"type": "function", "function": {"name": "a", "parameters": ADD, "strict": True}}])
    (call,) = reply.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"a": 3, "b": "x"}
    grammar = engine.calls[0]["params"].grammar
    assert '"[ARGS]"' in grammar and "<[" not in grammar
    matcher = LLMatcher(from_tokenizer(tok), grammar)
    assert matcher.consume_tokens(tok.encode('a[ARGS]{"a": 3, "b": "x"}', add_special_tokens=False) + [tok.eos_token_id])
    assert not matcher.is_error()


async def test_grammar_tools_need_a_format_that_holds_raw_input():
    """A custom grammar tool's raw input sits verbatim in a Hermes call; Llama's format (JSON arguments, quoted
    by its template) cannot hold it: a 400 naming the tool, nothing generated."""
    import openai

    from molt.testing.scripted import ScriptedEngine

    tok = family_tokenizer("llama3.2.jinja")
    engine = ScriptedEngine(tok, ["ok"], max_model_len=8192)
    async with live_capture_server(engine, tok) as server:
        with pytest.raises(openai.BadRequestError, match="'exec' takes raw input"):
            await api(await server.open_session()).responses.create(
                model="m", input="Go.", tools=[{"type": "custom", "name": "exec", "format": CODE}])
    assert not engine.calls
