"""32 concurrent sessions on one server and one real engine (batched): no cross-talk, every segment exact."""
import asyncio

from openai import AsyncOpenAI

from molt.testing.scripted import RecordingEngine, live_capture_server
from molt.types import SamplingParams


async def test_32_sessions_no_cross_talk(hf_engine, tokenizer):
    engine = RecordingEngine(hf_engine)

    async def rollout(server, i):
        session = await server.open_session(f"roll-{i}", SamplingParams(max_tokens=6))
        api = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key)
        messages = [{"role": "user", "content": f"agent {i} says hello"}]
        replies = []
        for turn in range(2):
            reply = await api.chat.completions.create(model=session.model_name, messages=messages, seed=i)
            replies.append(reply.choices[0].message.content)
            messages += [{"role": "assistant", "content": replies[-1]}, {"role": "user", "content": f"{i}:{turn}"}]
        return session, replies, await session.close()

    async with live_capture_server(engine, tokenizer) as server:
        results = await asyncio.gather(*(rollout(server, i) for i in range(32)))
        assert not server.sessions  # closed sessions are gone
    assert len(engine.records) == 64
    for i, (session, replies, segments) in enumerate(results):
        (segment,) = segments
        (p1, c1), (p2, c2) = engine.of_session(session.session_id)
        assert f"agent {i} says hello" in tokenizer.decode(p1)
        assert replies == [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in (c1, c2)]
        assert p2[:len(p1) + len(c1.token_ids)] == p1 + c1.token_ids  # turn 2 continues turn 1 exactly
        assert segment.token_ids == p2 + c2.token_ids
        assert segment.num_actions == len(c1.token_ids) + len(c2.token_ids)
        assert segment.behavior_logprobs[len(p2):] == c2.logprobs
