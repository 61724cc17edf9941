"""Many concurrent sessions on one server and one real engine (batched): no cross-talk, every segment exact."""

import asyncio
import itertools

import numpy as np
import pytest
from openai import AsyncOpenAI

from molt.testing.scripted import RecordingEngine, live_capture_server
from molt.types import SamplingParams


@pytest.mark.parametrize("sessions,turns", [(32, 2), (128, 3)])
async def test_sessions_no_cross_talk(hf_engine, tokenizer, sessions, turns):
    engine = RecordingEngine(hf_engine)

    async def rollout(server, i):
        session = await server.open_session(f"roll-{i}", SamplingParams(max_tokens=6))
        api = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key)
        messages = [{"role": "user", "content": f"agent {i} says hello"}]
        replies = []
        for turn in range(turns):
            reply = await api.chat.completions.create(model=session.model_name, messages=messages, seed=i)
            replies.append(reply.choices[0].message.content)
            messages += [
                {"role": "assistant", "content": replies[-1]},
                {"role": "user", "content": f"{i}:{turn}"},
            ]
        await api.close()
        return session, replies, await session.close()

    async with live_capture_server(engine, tokenizer) as server:
        results = await asyncio.gather(*(rollout(server, i) for i in range(sessions)))
        assert not server.sessions  # closed sessions are gone
    assert len(engine.records) == sessions * turns and hf_engine.num_requests == 0
    for i, (session, replies, segments) in enumerate(results):
        (segment,) = segments
        calls = engine.of_session(session.session_id)
        assert f"agent {i} says hello" in tokenizer.decode(calls[0][0])
        assert replies == [tokenizer.decode(c.token_ids, skip_special_tokens=True) for _, c in calls]
        for (p1, c1), (p2, _) in itertools.pairwise(calls):  # each turn continues the one before exactly
            assert p2[: len(p1) + len(c1.token_ids)] == p1 + c1.token_ids
        prompt, last = calls[-1]
        assert segment.token_ids.tolist() == prompt + last.token_ids
        assert segment.num_actions == sum(len(c.token_ids) for _, c in calls)
        assert segment.behavior_logprobs[-len(last.logprobs) :].tolist() == np.float32(last.logprobs).tolist()
