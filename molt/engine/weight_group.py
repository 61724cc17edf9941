"""A dedicated collective group for weight refit: trainer rank 0 broadcasts each bucket of full weights to every
engine at once (NCCL between GPUs, gloo on CPU), instead of passing it through the Ray object store.

Design notes and decisions: docs/internals.md, section `molt/engine/weight_group.py`.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

# (HF name, full shape, dtype name) per tensor, one list per bucket
BucketPlan = Sequence[tuple[str, Sequence[int], str]]


class WeightGroup:
    """One member of a refit group. `send` on rank 0, `receive` on the others, bucket by bucket in plan order."""

    def __init__(
        self,
        address: str,
        rank: int,
        world: int,
        device: str | torch.device = "cpu",
        timeout_s: float = 600.0,
    ):
        if world < 2 or not 0 <= rank < world:
            raise ValueError(
                f"weight group: rank {rank} of world {world} (need 0 <= rank < world, world >= 2)"
            )
        host, port = address.rsplit(":", 1)
        self.rank, self.world, self.device = rank, world, torch.device(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        # rank 0 hosts the store; the constructor returns once every member has connected
        self._store = dist.TCPStore(host, int(port), world, rank == 0, timeout=timeout)
        store = dist.PrefixStore("molt-weights", self._store)
        if self.device.type == "cuda":
            self._pg = dist.ProcessGroupNCCL(store, rank, world)
        else:
            self._pg = dist.ProcessGroupGloo(store, rank, world, timeout)

    def send(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Rank 0: broadcast one bucket (its tensors in plan order)."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 of a weight group sends")
        offsets, total = _layout([(t.shape, t.dtype) for _, t in bucket])
        flat = torch.empty(total, dtype=torch.uint8, device=self.device)
        for (_, t), offset in zip(bucket, offsets):
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
            flat[offset : offset + raw.numel()].copy_(raw)
        self._pg.broadcast(flat, 0).wait()
        # NCCL's wait() only orders streams: keep one bucket's buffer alive at a time
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def receive(self, plan: BucketPlan) -> list[tuple[str, torch.Tensor]]:
        """Ranks > 0: receive the bucket `plan` describes, as (name, tensor) on this member's device."""
        specs = [(tuple(shape), getattr(torch, dtype)) for _, shape, dtype in plan]
        offsets, total = _layout(specs)
        flat = torch.empty(total, dtype=torch.uint8, device=self.device)
        self._pg.broadcast(flat, 0).wait()
        return [
            (name, flat[offset : offset + math.prod(shape) * dt.itemsize].view(dt).view(shape))
            for (name, _, _), (shape, dt), offset in zip(plan, specs, offsets)
        ]


_ALIGN = 16


def _layout(specs: Sequence[tuple[Sequence[int], torch.dtype]]) -> tuple[list[int], int]:
    """Byte offset of each tensor in a bucket's flat buffer, each aligned to 16 bytes (a typed view of a uint8
    buffer needs an offset that is a multiple of its element size), and the buffer's length."""
    offsets, total = [], 0
    for shape, dt in specs:
        total = -(-total // _ALIGN) * _ALIGN
        offsets.append(total)
        total += math.prod(shape) * dt.itemsize
    return offsets, total


class InProcessWeightReceiver:
    """The collective-refit side of an engine whose model lives in this process (mixed into `HFEngine`):
    `join_weight_group` takes one rank; `receive_weights` receives each planned bucket and loads it with the
    engine's own `update_weights` (so it runs while the engine is paused, like any refit)."""

    weight_group_size = 1  # ranks this engine takes in a refit group
    _weight_group: WeightGroup | None = None

    async def join_weight_group(self, address: str, rank: int, world: int) -> None:
        import asyncio

        # blocks until every member has joined: keep the event loop (agents, HTTP) running meanwhile
        self._weight_group = await asyncio.to_thread(WeightGroup, address, rank, world, self.device)

    async def weight_sums(self) -> dict[str, float]:
        """{HF name: float64 sum} of the loaded weights: a cheap fingerprint to check that a refit landed."""
        return {n: float(t.double().sum()) for n, t in self.model.state_dict().items()}

    async def receive_weights(self, plan: Sequence[BucketPlan], version: int) -> None:
        import asyncio

        if self._weight_group is None:
            raise RuntimeError("receive_weights before join_weight_group")
        for bucket in plan:
            await self.update_weights(await asyncio.to_thread(self._weight_group.receive, bucket), version)
