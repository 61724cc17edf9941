"""The rollout worker's refit boundary without partial rollout: `begin_refit` holds new requests back and
returns only after the requests in flight have finished, so no completion mixes policy versions; requests
that arrive during the refit run afterwards on the new version. Ordered by events, not by time: the engine
holds the second half of its reply until the test releases it."""

import asyncio

from molt.runtime.worker import RefitGate, RolloutWorker
from molt.testing.scripted import ScriptedEngine
from molt.types import SamplingParams


async def test_refit_waits_for_the_completion_in_flight(tokenizer):
    engine = ScriptedEngine(tokenizer, ["one two three four five six"], hold=asyncio.Event())
    worker = RolloutWorker("unused", "unused")
    worker.engine = gate = RefitGate(engine)
    streamed = asyncio.Event()
    first = asyncio.create_task(gate.generate([5, 6], SamplingParams(), on_tokens=lambda ids: streamed.set()))
    await streamed.wait()  # the first half is out; the engine now holds the rest
    refit = asyncio.create_task(worker.begin_refit(partial=False))
    late = asyncio.create_task(gate.generate([7, 8], SamplingParams()))  # arrives during the refit
    for _ in range(20):
        await asyncio.sleep(0.01)
    assert not refit.done() and len(engine.calls) == 1  # waiting for the completion; the late one held back
    engine.hold.set()
    await refit
    assert first.done() and len(engine.calls) == 1
    await worker.update_weights([[("w", None)]], 1)
    await worker.end_refit()
    done, after = await first, await late
    assert set(done.versions) == {0} and set(after.versions) == {1}


def test_weights_cross_the_object_store_packed(ray_local):
    """The refit's buckets: every dtype (bfloat16 has no numpy twin) and shape, a 0-d tensor and a strided one
    come back equal; (name, tensor) pairs pass through unpacking unchanged."""
    import ray
    import torch

    from molt.engine.base import pack_weights, unpack_weights

    bucket = [
        ("a", torch.randn(3, 4)),
        ("b", torch.randn(5).to(torch.bfloat16)),
        ("c", torch.tensor(7)),
        ("d", torch.arange(12.0).view(3, 4).t()),
        ("e", torch.zeros(0, 2, dtype=torch.int64)),
    ]
    back = unpack_weights(ray.get(ray.put(pack_weights(bucket))))
    assert [n for n, _ in back] == [n for n, _ in bucket]
    for (_, t), (_, u) in zip(bucket, back):
        assert u.dtype == t.dtype and u.shape == t.shape and torch.equal(u, t)
    assert unpack_weights(bucket) == bucket  # plain pairs pass through
