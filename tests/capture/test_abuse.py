"""The capture server under abuse: clients that go away mid-stream, many concurrent sessions, fuzzed bodies."""

import asyncio

import pytest
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from molt.testing.scripted import RecordingEngine, live_capture_server
from molt.types import SamplingParams


class Watching(RecordingEngine):
    """Records how each generate call ended: its finish reason, or "cancelled"."""

    def __init__(self, engine):
        super().__init__(engine)
        self.ended: asyncio.Queue = asyncio.Queue()

    async def generate(self, *args, **kwargs):
        try:
            completion = await super().generate(*args, **kwargs)
        except asyncio.CancelledError:
            self.ended.put_nowait("cancelled")
            raise
        self.ended.put_nowait(completion.finish_reason.value)
        return completion


async def _openai_first_chunk(session):
    api = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    stream = await api.chat.completions.create(
        model=session.model_name, stream=True, messages=[{"role": "user", "content": "tell me everything"}]
    )
    async for _ in stream:
        break
    await stream.close()


async def _anthropic_first_chunk(session):
    api = AsyncAnthropic(base_url=session.session_url, api_key=session.api_key, max_retries=0)
    async with api.messages.stream(
        model=session.model_name, max_tokens=400, messages=[{"role": "user", "content": "tell me everything"}]
    ) as stream:
        async for _ in stream:
            break


@pytest.mark.parametrize(
    "first_chunk", [_openai_first_chunk, _anthropic_first_chunk], ids=["openai", "anthropic"]
)
async def test_a_client_that_disconnects_mid_stream_aborts_its_engine_request(
    hf_engine, tokenizer, first_chunk
):
    """The reply would take 400 tokens (min_tokens: no early end); the client reads the first chunk and closes
    the stream. The engine request ends cancelled, not finished; nothing is recorded; the session still works."""
    engine = Watching(hf_engine)
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session("gone", SamplingParams(max_tokens=400, min_tokens=400))
        await first_chunk(session)
        assert await asyncio.wait_for(engine.ended.get(), 120) == "cancelled"
        assert hf_engine.num_requests == 0 and not engine.records
        session.defaults = SamplingParams(max_tokens=3)
        reply = await AsyncOpenAI(base_url=session.base_url, api_key=session.api_key).chat.completions.create(
            model=session.model_name, messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.usage.completion_tokens <= 3 and await engine.ended.get() in ("stop", "length")
        (segment,) = await session.close()  # only the second request was recorded
        assert segment.num_actions == reply.usage.completion_tokens
