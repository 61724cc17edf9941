"""Session-sticky routing: stickiness, least-loaded placement, abort routing and fan-out of control calls."""

import asyncio

import pytest

from molt.engine.base import Engine
from molt.engine.router import Router
from molt.types import Completion, FinishReason, SamplingParams


class Recorder:
    """A minimal engine that answers with its own index and can hold requests open."""

    def __init__(self, index):
        self.index, self.model_name, self.max_model_len, self.eos_token_ids = index, "m", 64, [0]
        self.release = asyncio.Event()
        self.calls, self.aborted, self.weights, self._version = [], [], [], 0

    async def generate(self, prompt_ids, params, session_id=None, request_id=None):
        self.calls.append(request_id)
        await self.release.wait()
        return Completion([self.index], [0.0], [self._version], FinishReason.STOP)

    async def abort(self, request_id):
        self.aborted.append(request_id)

    async def pause(self):
        pass

    async def update_weights(self, named_tensors, version):
        self.weights.append(list(named_tensors))
        self._version = version

    async def resume(self):
        pass

    @property
    def version(self):
        return self._version

    async def close(self):
        pass


async def test_sessions_stick_and_sessionless_requests_balance():
    engines = [Recorder(i) for i in range(3)]
    router = Router(engines)
    assert isinstance(router, Engine)
    for e in engines:
        e.release.set()
    first = [
        (await router.generate([1], SamplingParams(), session_id=f"s{i}")).token_ids[0] for i in range(12)
    ]
    again = [
        (await router.generate([1], SamplingParams(), session_id=f"s{i}")).token_ids[0] for i in range(12)
    ]
    assert first == again and len(set(first)) > 1
    for e in engines:
        e.release.clear()
    held = [asyncio.create_task(router.generate([1], SamplingParams(), request_id=f"r{i}")) for i in range(6)]
    await asyncio.sleep(0)
    assert router._load == [2, 2, 2]  # least-loaded placement spreads them evenly
    assert sorted(c for e in engines for c in e.calls if c.startswith("r")) == [f"r{i}" for i in range(6)]
    await router.abort("r4")
    assert sum(e.aborted == ["r4"] for e in engines) == 1
    for e in engines:
        e.release.set()
    await asyncio.gather(*held)
    assert router._load == [0, 0, 0] and router._owner == {}


async def test_control_calls_fan_out_and_weights_are_materialized_once():
    engines = [Recorder(i) for i in range(2)]
    router = Router(engines)
    await router.pause()
    await router.update_weights(((f"w{i}", i) for i in range(3)), version=4)  # a one-shot generator
    await router.resume()
    assert [e.weights for e in engines] == [[[("w0", 0), ("w1", 1), ("w2", 2)]]] * 2 and router.version == 4


def test_rejects_no_engines_and_mixed_models():
    with pytest.raises(ValueError, match="at least one"):
        Router([])
    other = Recorder(1)
    other.model_name = "other"
    with pytest.raises(ValueError, match="same model"):
        Router([Recorder(0), other])
