"""Structured outputs on the three wires, with the official SDKs' own parse paths against a capture server on the
real embedded engine. The tiny model's samples are random, so a reply that parses and validates over several
seeds shows the constraint (`SamplingParams.json_schema`, molt.engine.sampling); a schema llguidance cannot
compile is a 400 naming the field."""

import json
from typing import Literal

import anthropic
import jsonschema
import openai
import pytest
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

from molt.testing.scripted import RecordingEngine, live_capture_server
from molt.types import SamplingParams

SEEDS = range(3)
RESPONSES_SEED = 0


class Verdict(BaseModel):
    ok: bool
    pick: Literal["red", "green", "blue"]
    n: int = Field(ge=0, le=99)
    note: str = Field(max_length=6)


class Choice(BaseModel):
    """For the Anthropic SDK, which moves bounds (minimum, maxLength, ...) out of the schema it sends into
    descriptions, and then validates the reply against them."""

    ok: bool
    pick: Literal["red", "green", "blue"]


SCHEMA = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}
    },
    "required": ["items"],
    "additionalProperties": False,
}
USER = [{"role": "user", "content": "Judge it, as JSON."}]


def any_object(finish_reason, text):
    """json_object: the random model's free strings may run past max_tokens, but a reply is an object's opening
    at least and, finished, an object; whether it finished."""
    assert text.startswith("{"), text
    if finish_reason == "stop":
        assert isinstance(json.loads(text), dict), text
    return finish_reason == "stop"


def openai_client(session):
    return AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)


def anthropic_client(session):
    return AsyncAnthropic(base_url=session.session_url, api_key=session.api_key, max_retries=0)


async def test_openai_chat_completions(hf_engine, tokenizer):
    engine = RecordingEngine(hf_engine)
    async with live_capture_server(engine, tokenizer) as server:
        api = openai_client(await server.open_session())
        finished = []
        for seed in SEEDS:
            reply = await api.chat.completions.parse(
                model="m", messages=USER, response_format=Verdict, max_tokens=120, seed=seed
            )
            assert isinstance(reply.choices[0].message.parsed, Verdict), reply.choices[0].message.content
            raw = await api.chat.completions.create(
                model="m",
                messages=USER,
                max_tokens=120,
                seed=seed,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "items", "schema": SCHEMA, "strict": True},
                },
            )
            jsonschema.validate(json.loads(raw.choices[0].message.content), SCHEMA)
            free = await api.chat.completions.create(
                model="m", messages=USER, max_tokens=300, seed=seed, response_format={"type": "json_object"}
            )
            finished.append(any_object(free.choices[0].finish_reason, free.choices[0].message.content))
        assert any(finished)
        async with api.chat.completions.stream(
            model="m", messages=USER, response_format=Verdict, max_tokens=120, seed=9
        ) as stream:
            assert isinstance((await stream.get_final_completion()).choices[0].message.parsed, Verdict)
        assert len({r[2].token_ids[3] for r in engine.records}) > 1  # random samples, all valid
        with pytest.raises(
            openai.BadRequestError, match="response_format: json_schema: .*regex parse error"
        ) as e:
            await api.chat.completions.create(
                model="m",
                messages=USER,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}},
                },
            )
        assert e.value.body["param"] == "response_format"
        with pytest.raises(openai.BadRequestError, match="response_format: type 'xml' is not one of"):
            await api.chat.completions.create(model="m", messages=USER, response_format={"type": "xml"})


async def test_anthropic_messages(hf_engine, tokenizer):
    async with live_capture_server(hf_engine, tokenizer) as server:
        api = anthropic_client(await server.open_session())
        for seed in SEEDS:  # the session seeds each call its own way (no request seed on this wire)
            reply = await api.messages.parse(model="m", max_tokens=120, output_format=Choice, messages=USER)
            assert isinstance(reply.parsed_output, Choice), reply.content
            raw = await api.messages.create(
                model="m",
                max_tokens=120,
                messages=USER,
                output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
            )
            jsonschema.validate(json.loads(raw.content[0].text), SCHEMA)
        with pytest.raises(
            anthropic.BadRequestError, match="output_config.format: json_schema: .*Invalid type"
        ):
            await api.messages.create(
                model="m",
                max_tokens=8,
                messages=USER,
                output_config={"format": {"type": "json_schema", "schema": {"type": "nonsense"}}},
            )


async def test_openai_responses(hf_engine, tokenizer):
    async with live_capture_server(hf_engine, tokenizer) as server:
        # this wire has no request seed: the session's own seeds each call (else the test would hang on chance)
        api = openai_client(
            await server.open_session("r", SamplingParams(seed=RESPONSES_SEED, max_tokens=None))
        )
        for _ in SEEDS:
            reply = await api.responses.parse(
                model="m", input="Judge it, as JSON.", text_format=Verdict, max_output_tokens=120
            )
            assert isinstance(reply.output_parsed, Verdict), reply.output_text
        finished = []
        for _ in SEEDS:
            free = await api.responses.create(
                model="m",
                input="JSON please",
                max_output_tokens=300,
                text={"format": {"type": "json_object"}},
            )
            finished.append(any_object("stop" if free.status == "completed" else "length", free.output_text))
        assert any(finished)
