"""Tool calls under the reply grammar (`tools.hermes_grammar`, `Session._constrain`) on the real embedded engine
with the tiny random model at T=1: unconstrained it writes garbage, so replies whose calls parse and whose inputs
match their grammar or schema over several seeds show the constraint. Through the official `openai` SDK."""
import json
import re

import jsonschema
from openai import AsyncOpenAI

from molt.testing.scripted import RecordingEngine, live_capture_server

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
