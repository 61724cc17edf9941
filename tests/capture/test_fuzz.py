"""Property-based fuzzing of both wires with hypothesis: request bodies drawn from the wires' own request schemas
(the pydantic models' JSON schema, also mutated and replaced by junk) against a live capture server and a real
tiny engine. For every body: no 5xx; a 4xx shaped like OpenAI's / Anthropic's errors; a 200 that the official
SDK's types accept (or a well-formed event stream); and afterwards no session and no engine request left.

The engine's model has a 128-token window, so that a body asking for any number of tokens stays cheap. The
default run draws FUZZ_EXAMPLES (40) bodies per wire with a fixed seed; `-m slow` draws FUZZ_LONG_EXAMPLES (400)
at random."""

import asyncio
import collections
import json
import os
import threading

import httpx
import pytest
from anthropic.types import Message
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from molt.capture import anthropic_wire, openai_wire
from molt.types import SamplingParams

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
WIRES = {"openai": (openai_wire, "/v1/chat/completions"), "anthropic": (anthropic_wire, "/v1/messages")}


def from_schema(node: dict, defs: dict) -> st.SearchStrategy:
    """Values valid under (the subset of JSON schema that pydantic emits for) `node`."""
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[1]
        return st.deferred(lambda: from_schema(defs[name], defs))
    for key in ("anyOf", "oneOf"):
        if key in node:
            return st.one_of([from_schema(n, defs) for n in node[key]])
    if "const" in node:
        return st.just(node["const"])
    if "enum" in node:
        return st.sampled_from(node["enum"])
    kind = node.get("type")
    if kind == "object" and "properties" in node:
        fields = {k: from_schema(v, defs) for k, v in node["properties"].items()}
        required = set(node.get("required", ()))
        return st.fixed_dictionaries(
            {k: v for k, v in fields.items() if k in required},
            optional={k: v for k, v in fields.items() if k not in required},
        )
    if kind == "array":
        low = node.get("minItems", 0)
        return st.lists(from_schema(node.get("items", {}), defs), min_size=low, max_size=low + 3)
    if kind == "integer":
        return st.integers(node.get("minimum"), node.get("maximum"))
    if kind == "number":
        low = node.get("minimum", node.get("exclusiveMinimum"))
        return st.floats(low, node.get("maximum"), exclude_min="exclusiveMinimum" in node, allow_nan=False)
    return {
        "string": st.text(max_size=24),
        "boolean": st.booleans(),
        "null": st.none(),
        "object": st.dictionaries(st.text(max_size=6), JSON, max_size=3),
    }.get(kind, JSON)


def bodies(model) -> st.SearchStrategy[bytes]:
    """Valid bodies, valid ones with one field replaced by any JSON, dicts of junk, and bytes that are no JSON."""
    schema = model.model_json_schema()
    valid = from_schema(schema, schema.get("$defs", {}))
    mutated = valid.flatmap(
        lambda body: st.sampled_from(sorted(body)).flatmap(
            lambda key: JSON.map(lambda value: {**body, key: value})
        )
    )
    junk = st.dictionaries(
        st.sampled_from(sorted(model.model_fields)) | st.text(max_size=6), JSON, max_size=6
    )
    return st.one_of(valid, valid, mutated, junk, JSON).map(lambda b: json.dumps(b).encode()) | st.binary(
        max_size=40
    )


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A capture server and a real engine on an event loop of their own thread (hypothesis calls synchronously)."""
    from transformers import AutoTokenizer

    from molt.capture.render import ChatRenderer
    from molt.capture.server import CaptureServer
    from molt.engine.hf import HFEngine
    from molt.testing.models import build_tiny_llama

    path = build_tiny_llama(tmp_path_factory.mktemp("tiny-128"), max_positions=128)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def call(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(300)

    engine = HFEngine(str(path))
    server = CaptureServer(engine, ChatRenderer(AutoTokenizer.from_pretrained(path)))
    call(server.start())
    yield server, engine, call
    call(server.stop())
    call(engine.close())
    loop.call_soon_threadsafe(loop.stop)


def check_reply(wire: str, response: httpx.Response, body: bytes) -> None:
    assert response.status_code < 500, (response.status_code, response.text, body)
    if response.status_code >= 400:
        error = response.json()
        if wire == "openai":
            assert (
                set(error) == {"error"}
                and isinstance(error["error"]["message"], str)
                and error["error"]["type"]
            )
        else:
            assert (
                error["type"] == "error"
                and isinstance(error["error"]["message"], str)
                and error["error"]["type"]
            )
        return
    assert response.status_code == 200
    if not response.headers["content-type"].startswith("text/event-stream"):
        (ChatCompletion if wire == "openai" else Message).model_validate(response.json())
        return
    data = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert data and (wire == "anthropic" or data[-1] == "[DONE]"), response.text
    for line in data[:-1] if wire == "openai" else data:
        event = json.loads(line)
        if wire == "openai" and "error" not in event:
            ChatCompletionChunk.model_validate(event)


def fuzz(live, wire: str, examples: int, derandomize: bool) -> None:
    server, engine, call = live
    module, path = WIRES[wire]
    seen = collections.Counter()

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=derandomize,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(body=bodies(module.SCHEMA))
    @example(
        body=b'{"model": "", "messages": [{"role": "user"}], "temperature": 1e-308, "logprobs": true}'
    )  # found
    def check(body: bytes) -> None:
        session = call(server.open_session("fuzz", SamplingParams(max_tokens=4)))
        try:
            headers = {
                "authorization": f"Bearer {session.api_key}",
                "x-api-key": session.api_key,
                "content-type": "application/json",
            }
            response = httpx.post(
                session.base_url + path.removeprefix("/v1"), content=body, headers=headers, timeout=300
            )
            check_reply(wire, response, body)
            seen[response.status_code] += 1
        finally:
            call(session.close())
        assert not server.sessions and engine.num_requests == 0  # nothing leaked

    check()
    assert seen[200] and seen[400], seen  # the bodies reach generation as well as the validation


@pytest.mark.parametrize("wire", WIRES)
def test_fuzzed_bodies_get_no_5xx_and_leak_nothing(live, wire):
    fuzz(live, wire, int(os.environ.get("FUZZ_EXAMPLES", "40")), derandomize=True)


@pytest.mark.slow
@pytest.mark.parametrize("wire", WIRES)
def test_fuzzed_bodies_get_no_5xx_and_leak_nothing_long(live, wire):
    fuzz(live, wire, int(os.environ.get("FUZZ_LONG_EXAMPLES", "400")), derandomize=False)
