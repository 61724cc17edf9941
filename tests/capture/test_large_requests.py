"""Oversized requests are refused cheaply (a body limit, a character count against the window, before any
tokenizing), and one session's large request does not hold up another session's small one."""

import asyncio
import threading
import time

import httpx

from molt.capture.session import Session
from molt.testing.scripted import ScriptedEngine, live_capture_server
from molt.types import SamplingParams


def chat(text):
    return {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": text}]}


async def post(http, session, body, path="chat/completions"):
    return await http.post(
        f"/s/{session.session_id}/v1/{path}",
        json=body,
        headers={
            "Authorization": f"Bearer {session.api_key}",
            "x-api-key": session.api_key,
            "anthropic-version": "2023-06-01",
        },
    )


async def test_oversized_requests_are_refused_before_tokenizing(hf_engine, tokenizer, monkeypatch):
    tokenized = []
    async with live_capture_server(hf_engine, tokenizer, max_request_mb=1) as server:
        render = server.renderer.render
        monkeypatch.setattr(server.renderer, "render", lambda *a, **k: tokenized.append(1) or render(*a, **k))
        session = await server.open_session("r", SamplingParams(max_tokens=4))
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            over_window = await post(http, session, chat("word " * 100_000))  # 0.5 MB, a 512-token window
            too_big = await post(
                http, session, {**chat("x " * 600_000), "max_tokens": 4}, "messages"
            )  # 1.2 MB
    assert over_window.status_code == 400, over_window.text
    assert over_window.json()["error"]["code"] == "context_length_exceeded"
    assert "characters" in over_window.json()["error"]["message"]
    assert too_big.status_code == 413 and too_big.json()["error"]["type"] == "request_too_large"
    assert "max_request_mb" in too_big.json()["error"]["message"]
    assert not tokenized


async def test_a_large_request_does_not_hold_up_another_session(hf_engine, tokenizer):
    """Session A sends a message that takes seconds to render and tokenize (the character check is off, so it
    is tokenized and then refused by the window); session B's small requests meanwhile are answered within
    about twice their usual latency on a quiet machine, and in a small fraction of A's time on a loaded one."""
    async with live_capture_server(hf_engine, tokenizer, max_chars_per_token=0) as server:
        rendering, render = threading.Event(), server.renderer.render

        def watched(*args, **kwargs):
            if len(repr(args)) > 1_000_000:  # A's
                rendering.set()
            return render(*args, **kwargs)

        server.renderer.render = watched
        a, b = [await server.open_session(r, SamplingParams(max_tokens=4)) for r in "ab"]
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:

            async def small():
                start = time.perf_counter()
                assert (await post(http, b, chat("hi"))).status_code == 200
                return time.perf_counter() - start

            usual = min([await small() for _ in range(5)])
            start = time.perf_counter()
            large = asyncio.create_task(post(http, a, chat("hello world, many words. " * 100_000)))  # 2.5 MB
            assert await asyncio.to_thread(rendering.wait, 60), "A never reached the renderer"
            during = [await small() for _ in range(3)]
            assert not large.done(), "the large request should still be tokenizing"
            refused = await large
            took = time.perf_counter() - start
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    assert took > 1.0, f"the large request took only {took:.2f} s: too small to show anything"
    # Blocked behind A's tokenizing, a small request would wait most of `took`; a tenth of it leaves a wide margin
    # on a loaded machine, where a small request's latency swings well past twice its quiet value.
    assert max(during) <= max(2 * usual + 0.05, took / 10), (
        f"small requests took {during} s during the large one ({took:.2f} s), {usual:.3f} s alone"
    )


async def test_the_character_bound_walks_only_bodies_over_it(tokenizer, monkeypatch):
    """A body within max_chars_per_token x the window holds no more characters than that (each took a byte at
    least): its messages are not walked, so a turn's check does not grow with the history. Over it, the count
    decides: 3,000 characters in a 9 KB body (3 bytes each in UTF-8) pass, 9,000 plain ones are refused."""
    walks = []
    fits = Session._fits
    monkeypatch.setattr(Session, "_fits", lambda self, *parts: walks.append(1) or fits(self, *parts))
    engine = ScriptedEngine(tokenizer, max_model_len=16384)
    async with live_capture_server(engine, tokenizer, max_chars_per_token=0.5) as server:  # 8,192 characters
        session = await server.open_session("r", SamplingParams(max_tokens=4))
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            small = await post(http, session, chat("hello " * 1000))  # 6 KB
            assert (small.status_code, len(walks)) == (200, 0), small.text
            wide = await post(http, session, chat("\u20ac" * 3000))  # the euro sign
            assert (wide.status_code, len(walks)) == (200, 1), wide.text
            over = await post(http, session, chat("x" * 9000))
    assert len(walks) == 2 and over.status_code == 400 and "characters" in over.json()["error"]["message"]
    assert len(await session.close()) == 2  # the two answered requests, new conversations each
