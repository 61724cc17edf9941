"""The refit: the trainer's weights into every rollout engine, through the object store or a collective group.

Through the object store (the default with the embedded engine), the trainer ranks put the weights bucket by
bucket while the workers drain, and each worker loads them (`Workers.refit`, which also replaces dead workers).
With the collective refit group (`train.weight_sync`: collective, or auto with vLLM), trainer rank 0 and every
engine process form one torch.distributed group, and rank 0 broadcasts the buckets once every engine is paused.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

BUCKET_BYTES = 64 << 20


class WeightSync:
    def __init__(self, trainer: Any, workers: Any, partial_rollout: bool):
        """trainer: the `TrainerGroup`; workers: the `Workers`; partial_rollout: `train.partial_rollout_enable`."""
        self.trainer, self.workers, self.partial_rollout = trainer, workers, partial_rollout
        self.plan: list | None = None  # the collective group's bucket plan; None: through the object store

    async def join(self) -> None:
        """Trainer rank 0 (the sender, rank 0) and every engine process form the refit group."""
        rank0, workers = self.trainer.ranks[0], self.workers.actors
        address = await rank0.master_address.remote()
        sizes = await asyncio.gather(*[w.weight_group_size.remote() for w in workers])
        world, offsets = 1 + sum(sizes), [1 + sum(sizes[:i]) for i in range(len(sizes))]
        self.workers.budget.limit = 0  # a new worker could not join the group
        await asyncio.gather(
            self.trainer.same("join_weight_group", address, world),
            *[w.join_weight_group.remote(address, o, world) for w, o in zip(workers, offsets)],
        )
        self.plan = await rank0.weight_plan.remote(BUCKET_BYTES)

    async def refit(self, version: int) -> float:
        """Load the trainer's weights as policy `version` into every engine; returns the seconds it took."""
        t0, workers, partial_rollout = time.perf_counter(), self.workers.actors, self.partial_rollout
        if self.plan is None:  # the buckets go into the object store while the workers drain
            refs = asyncio.ensure_future(self.trainer.same("weight_refs", BUCKET_BYTES))
            await self.workers.refit(partial_rollout, refs, version)
            return time.perf_counter() - t0
        # collective: every engine is paused before rank 0 enters the broadcast (no rank waits on a drain)
        try:
            await asyncio.gather(*[w.begin_refit.remote(partial_rollout) for w in workers])
            await asyncio.gather(
                self.trainer.same("broadcast_weights", BUCKET_BYTES),
                *[w.receive_weights.remote(self.plan, version) for w in workers],
            )
        finally:
            await asyncio.gather(*[w.end_refit.remote() for w in workers])
        return time.perf_counter() - t0
