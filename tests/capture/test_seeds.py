"""Seeds of a rollout's model calls, with the real SDKs against the embedded engine on the tiny model: each call
of a seeded session samples from its own stream (`molt.types.call_seed`), a rerun of the seeded session
reproduces every call, and a seed the request sets itself is honoured."""

import pytest
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from molt.testing.scripted import RecordingEngine, live_capture_server
from molt.types import SamplingParams

USER = [{"role": "user", "content": "Tell me a story."}]


async def _ask(session, wire: str, stream: bool, **kwargs) -> None:
    if wire == "openai":
        api = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key)
        reply = await api.chat.completions.create(
            model=session.model_name, messages=USER, stream=stream, **kwargs
        )
    else:
        api = AsyncAnthropic(base_url=session.session_url, api_key=session.api_key)
        reply = await api.messages.create(
            model=session.model_name, max_tokens=12, messages=USER, stream=stream
        )
    if stream:
        async for _ in reply:
            pass


async def _rollout(server, engine, seed: int, asks) -> list[list[int]]:
    """The sampled tokens of each model call of one rollout seeded `seed`; `asks` makes the calls."""
    session = await server.open_session(f"r{len(engine.records)}", SamplingParams(max_tokens=12, seed=seed))
    await asks(session)
    await session.close()
    return [c.token_ids for _, c in engine.of_session(session.session_id)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("wire", ["openai", "anthropic"])
async def test_identical_calls_of_a_seeded_rollout_differ_and_a_rerun_repeats_them(
    hf_engine, tokenizer, wire, stream
):
    async def twice(session):
        for _ in range(2):
            await _ask(session, wire, stream)

    engine = RecordingEngine(hf_engine)
    async with live_capture_server(engine, tokenizer) as server:
        first = await _rollout(server, engine, 7, twice)
        rerun = await _rollout(server, engine, 7, twice)
        other = await _rollout(server, engine, 8, twice)
    assert first[0] != first[1]  # the second call does not replay the first one's draws
    assert rerun == first  # the seeded rollout is reproducible, call by call
    assert other[0] != first[0]


async def test_a_request_seed_is_honoured(hf_engine, tokenizer):
    """OpenAI semantics: the same request seed gives the same sample, whatever the rollout's seed."""

    async def seeded(session):
        for _ in range(2):
            await _ask(session, "openai", False, max_tokens=12, seed=5)

    engine = RecordingEngine(hf_engine)
    async with live_capture_server(engine, tokenizer) as server:
        calls = await _rollout(server, engine, 7, seeded) + await _rollout(server, engine, 8, seeded)
    assert calls[1:] == calls[:1] * 3
