"""The collective refit group (`molt.engine.weight_group`) on CPU/gloo: members in threads of this process."""

import asyncio
import socket
import threading

import pytest
import torch

from molt.engine.weight_group import WeightGroup


def _address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _plan(bucket):
    return [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in bucket]


def test_buckets_of_mixed_dtypes_arrive_bit_exact_at_every_member():
    g = torch.Generator().manual_seed(0)
    buckets = [
        [
            ("a", torch.randn(3, 5, generator=g)),
            ("b", torch.arange(7)),
            ("c", torch.randn(5, generator=g).bfloat16()),
        ],
        [("d", torch.randn(2, 3, 4, generator=g)), ("e", torch.tensor([True, False, True]))],
        [("f", torch.randn(1, generator=g).half()), ("g", torch.randn(9, generator=g))],  # odd byte offsets
    ]
    address, received = _address(), {}

    def member(rank: int) -> None:
        group = WeightGroup(address, rank, 3)
        received[rank] = [group.receive(_plan(b)) for b in buckets]

    threads = [threading.Thread(target=member, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    sender = WeightGroup(address, 0, 3)
    for bucket in buckets:
        sender.send(bucket)
    for t in threads:
        t.join(timeout=60)
    for rank in (1, 2):
        for sent, got in zip(buckets, received[rank]):
            assert [n for n, _ in got] == [n for n, _ in sent]
            for (_, a), (_, b) in zip(sent, got):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_bad_rank_is_a_clear_error():
    with pytest.raises(ValueError, match="rank 3 of world 2"):
        WeightGroup("127.0.0.1:1", 3, 2)


def test_hf_engine_receives_a_trained_actor_over_the_group(tiny_llama_dir):
    """The path the runtime takes: trainer rank 0 sends its planned buckets, a paused HFEngine receives and loads
    them; afterwards the engine's weights equal the trainer's (tied embeddings included) and its version moved."""
    from molt.engine.hf import HFEngine
    from molt.trainer import Actor

    actor = Actor.from_pretrained(tiny_llama_dir)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # stands for a training step: every weight moves
        for p in actor.lm.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    plan = actor.weight_plan(bucket_bytes=50_000)
    assert len(plan) > 2
    address, sender = _address(), {}

    def send() -> None:
        for bucket in actor.iter_weights(50_000):
            sender["group"].send(bucket)

    async def engine_side():
        engine = HFEngine(tiny_llama_dir)
        try:
            await asyncio.gather(
                engine.join_weight_group(address, 1, 2),
                asyncio.to_thread(lambda: sender.setdefault("group", WeightGroup(address, 0, 2))),
            )
            await engine.pause()
            await asyncio.gather(engine.receive_weights(plan, version=7), asyncio.to_thread(send))
            await engine.resume()
            return engine.version, {n: t.clone() for n, t in engine.model.state_dict().items()}
        finally:
            await engine.close()

    version, weights = asyncio.run(engine_side())
    assert version == 7
    trained = actor.lm.state_dict()
    assert weights.keys() == trained.keys()
    for name, t in trained.items():
        assert torch.equal(weights[name], t), name


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)"
)
def test_nccl_group_between_two_gpus():
    """The GPU path: the same wire over ProcessGroupNCCL (NCCL wants one device per rank)."""
    bucket = [("w", torch.randn(64, 32, device="cuda:0")), ("b", torch.arange(5, device="cuda:0"))]
    address, received = _address(), {}

    def member() -> None:
        torch.cuda.set_device(1)
        received[1] = WeightGroup(address, 1, 2, "cuda:1").receive(_plan(bucket))

    thread = threading.Thread(target=member)
    thread.start()
    torch.cuda.set_device(0)
    WeightGroup(address, 0, 2, "cuda:0").send(bucket)
    thread.join(timeout=120)
    for (_, a), (_, b) in zip(bucket, received[1]):
        assert b.device == torch.device("cuda:1") and torch.equal(a.cpu(), b.cpu())
