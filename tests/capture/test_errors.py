"""Client mistakes: a 4xx in the caller's wire shape, never a 5xx, and the session keeps working; an engine
failure: a 5xx in the same shape."""

import httpx
import openai
import pytest
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from molt.engine.base import EngineError, EngineGone
from molt.testing.scripted import ScriptedEngine, live_capture_server

GOOD = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
GOOD_ANTHROPIC = {**GOOD, "max_tokens": 8}


def openai_shaped(body):
    return set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])


def anthropic_shaped(body):
    return body["type"] == "error" and {"type", "message"} <= set(body["error"])


CASES = [  # (name, body, expected status, expected OpenAI code)
    ("malformed json", b'{"model": "scripted", "messages": [', 400, "invalid_json"),
    ("not an object", b"[1, 2]", 400, "invalid_json"),
    ("missing messages", {"model": "scripted"}, 400, "invalid_request"),
    ("missing model", {"messages": GOOD["messages"]}, 400, "invalid_request"),
    ("wrong type", {**GOOD, "temperature": "hot"}, 400, "invalid_request"),
    ("out of range", {**GOOD, "top_p": 0}, 400, "invalid_request"),
    ("bad role", {**GOOD, "messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_request"),
    (
        "image part",
        {**GOOD, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "invalid_request",
    ),
    ("unknown model (strict)", {**GOOD, "model": "gpt-9"}, 400, "model_not_found"),
    (
        "context too long",
        {**GOOD, "messages": [{"role": "user", "content": "word " * 600}]},
        400,
        "context_length_exceeded",
    ),
]


@pytest.fixture
async def served(tokenizer):
    async with live_capture_server(
        ScriptedEngine(tokenizer, ["fine"]), tokenizer, strict_model=True
    ) as server:
        session = await server.open_session()
        async with httpx.AsyncClient(base_url=server.url) as http:
            yield server, session, http


def content(body):
    return body if isinstance(body, bytes) else httpx.Request("POST", "/", json=body).content


@pytest.mark.parametrize("name,body,status,code", CASES, ids=[c[0] for c in CASES])
async def test_openai_errors(served, name, body, status, code):
    _, session, http = served
    r = await http.post(
        f"/s/{session.session_id}/v1/chat/completions",
        content=content(body),
        headers={"Authorization": f"Bearer {session.api_key}", "content-type": "application/json"},
    )
    assert r.status_code == status and openai_shaped(r.json()) and r.json()["error"]["code"] == code
    ok = await http.post(
        f"/s/{session.session_id}/v1/chat/completions",
        json=GOOD,
        headers={"Authorization": f"Bearer {session.api_key}"},
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "fine"


@pytest.mark.parametrize("name,body,status,code", CASES, ids=[c[0] for c in CASES])
async def test_anthropic_errors(served, name, body, status, code):
    _, session, http = served
    if isinstance(body, dict) and "messages" in body and name != "image part":
        body = {**body, "max_tokens": 8}
    if name == "image part":
        body = {
            **GOOD_ANTHROPIC,
            "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
        }
    r = await http.post(
        f"/s/{session.session_id}/v1/messages",
        content=content(body),
        headers={"x-api-key": session.api_key, "content-type": "application/json"},
    )
    assert r.status_code == status and anthropic_shaped(r.json())
    assert r.json()["error"]["type"] == "invalid_request_error"


async def test_auth_and_unknown_session(served):
    server, session, http = served
    other = await server.open_session()
    path = f"/s/{session.session_id}/v1/chat/completions"
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Bearer {other.api_key}"}):
        r = await http.post(path, json=GOOD, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = await http.post(
        f"/s/{session.session_id}/v1/messages", json=GOOD_ANTHROPIC, headers={"x-api-key": "nope"}
    )
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = await http.post(
        "/s/doesnotexist/v1/messages", json=GOOD_ANTHROPIC, headers={"x-api-key": session.api_key}
    )
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    await session.close()
    r = await http.post(path, json=GOOD, headers={"Authorization": f"Bearer {session.api_key}"})
    assert r.status_code == 404 and openai_shaped(r.json())
    assert (await http.get("/health")).json()["status"] == "ok"
    r = await http.post(f"/s/{other.session_id}/v1/embeddings", json={})
    assert r.status_code == 404 and openai_shaped(r.json())
    r = await http.get(f"/s/{other.session_id}/v1/messages")
    assert r.status_code == 405 and anthropic_shaped(r.json())


async def test_sdks_raise_their_own_errors(served):
    """The official SDKs parse our error bodies into their typed exceptions."""
    _, session, _ = served
    api = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        await api.chat.completions.create(model="nope", messages=GOOD["messages"])
    assert e.value.code == "model_not_found" and "nope" in e.value.message
    with pytest.raises(openai.AuthenticationError):
        await AsyncOpenAI(base_url=session.base_url, api_key="bad", max_retries=0).models.list()
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as e:
        await AsyncAnthropic(
            base_url=session.session_url, api_key=session.api_key, max_retries=0
        ).messages.create(
            model="scripted", max_tokens=8, messages=[{"role": "user", "content": "word " * 600}]
        )
    assert "context window" in e.value.message


async def test_an_engine_failure_is_a_5xx_that_the_sdks_raise(tokenizer):
    """An engine that failed is the server's fault, not the client's: 503 while the engine is gone (a new one is
    being started: a retry may succeed), 500 otherwise, in each wire's error shape; the session goes on."""
    import anthropic

    failures = []

    def reply(prompt_ids, params):
        if failures:
            raise failures.pop()
        return "fine"

    async with live_capture_server(ScriptedEngine(tokenizer, reply), tokenizer) as server:
        session = await server.open_session()
        oa = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        an = AsyncAnthropic(base_url=session.session_url, api_key=session.api_key, max_retries=0)
        calls = {
            "openai": lambda stream: oa.chat.completions.create(
                model="m", messages=GOOD["messages"], stream=stream
            ),
            "anthropic": lambda stream: an.messages.create(
                model="m", max_tokens=8, messages=GOOD["messages"], stream=stream
            ),
        }
        for wire, call in calls.items():
            for stream in (False, True):
                for error, status in (
                    (EngineGone("the engine process exited (exit code -9)"), 503),
                    (EngineError("the engine failed: RuntimeError('CUDA error')"), 500),
                ):
                    failures.append(error)
                    with pytest.raises((openai.InternalServerError, anthropic.InternalServerError)) as e:
                        await call(stream)
                    assert e.value.status_code == status and str(error) in e.value.message, (wire, stream)
                    if wire == "openai":
                        assert e.value.code == ("engine_unavailable" if status == 503 else "engine_error")
                    else:
                        assert e.value.body["error"]["type"] == "api_error"
        reply_ok = await oa.chat.completions.create(model="m", messages=GOOD["messages"])
        assert reply_ok.choices[0].message.content == "fine"
