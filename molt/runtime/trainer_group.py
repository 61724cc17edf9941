"""The trainer group: FSDP2 ranks as Ray actors sharing one torch.distributed group (gloo on CPU, NCCL on GPU).

Every call is collective: `TrainerGroup` calls the same method on every rank and waits for all. Each rank
receives only the light records of its own experiences (balanced by `assign_to_ranks`) and `reload()`s their
payloads from the object store itself: the controller never holds a batch's payloads.

Advantages. Group estimators (`molt.trainer.config.GROUP_ESTIMATORS`: grpo, rloo, dr_grpo) depend on rewards only: the controller computes one value
per rollout from the light records (`rollout_advantages`) and each rank spreads it over the action tokens of its
segments. Token-level estimators (reinforce, reinforce_baseline) are computed on each rank over its own share
of the window; their global whitening is therefore per rank (exact with one rank). GAE needs the critic, which
the runtime does not wire yet: it is refused at start-up.
"""
from __future__ import annotations

import os
import socket
from typing import Any

from molt.types import Experience

RANK_ESTIMATORS = ("reinforce", "reinforce_baseline")


def rollout_advantages(estimator: str, rollouts: list[tuple[str, str, float]], params: Any = None) -> dict[str, float]:
    """{rollout_id: advantage} for a group estimator, from (rollout_id, group_id, reward) rows."""
    import torch

    from molt.algo import AdvantageBatch, compute_advantages

    groups = {g: i for i, g in enumerate(dict.fromkeys(g for _, g, _ in rollouts))}
    batch = AdvantageBatch(
        rewards=torch.tensor([r for _, _, r in rollouts], dtype=torch.float64),
        group_ids=torch.tensor([groups[g] for _, g, _ in rollouts]),
        rollout_ids=torch.arange(len(rollouts)),
        action_mask=torch.ones(len(rollouts), 1, dtype=torch.bool),  # one "token" per rollout: a scalar each
    )
    adv = compute_advantages(estimator, batch, params).advantages[:, 0]
    return {rid: float(a) for (rid, _, _), a in zip(rollouts, adv)}


class TrainerRank:
    def __init__(self, rank: int, world: int, torch_threads: int = 0, estimator: str = "grpo",
                 advantage_params: dict[str, Any] | None = None):
        self.rank, self.world, self.torch_threads, self.estimator = rank, world, torch_threads, estimator
        self.advantage_params = advantage_params or {}
        self.actor: Any = None

    def master_address(self) -> str:
        """Called on rank 0: its node's address and a free port for the process group rendezvous."""
        import ray

        return f"{ray.util.get_node_ip_address()}:{_free_port()}"

    def setup(self, master: str, actor_fields: dict[str, Any]) -> None:
        addr, port = master.rsplit(":", 1)
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world), LOCAL_RANK="0", MASTER_ADDR=addr,
                          MASTER_PORT=port)
        import torch

        from molt.trainer import Actor, ActorConfig

        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        self.actor = Actor(ActorConfig(**actor_fields))

    def train_step(self, experiences: list[Experience], advantages: dict[str, float] | None) -> dict[str, float]:
        for exp in experiences:
            if exp.offloaded:
                exp.reload()
        if advantages is not None:
            for exp in experiences:
                a = advantages[exp.rollout_id]
                exp.advantages = [a if m else 0.0 for m in exp.action_mask]
        elif experiences:
            self._rank_advantages(experiences)
        return self.actor.train_step(experiences)

    def _rank_advantages(self, experiences: list[Experience]) -> None:
        from molt.algo import AdvantageBatch, AdvantageParams, compute_advantages

        batch = AdvantageBatch.from_experiences(experiences)
        adv = compute_advantages(self.estimator, batch, AdvantageParams(**self.advantage_params)).advantages
        for row, exp in enumerate(experiences):
            exp.advantages = adv[row, : exp.num_tokens].tolist()

    def weight_refs(self, bucket_bytes: int) -> list[Any]:
        """Stream full weights bucket by bucket into the object store (collective; rank 0 puts)."""
        import ray

        refs = []
        for bucket in self.actor.iter_weights(bucket_bytes):
            if self.rank == 0:
                refs.append(ray.put(bucket))
        return refs

    def save(self, path: str) -> None:
        self.actor.save(path)

    def load(self, path: str) -> None:
        self.actor.load(path)

    def export_hf(self, path: str) -> None:
        self.actor.export_hf(path)

    def step(self) -> int:
        return self.actor.step


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TrainerGroup:
    """Creates the rank actors and calls them collectively."""

    def __init__(self, world: int, *, torch_threads: int = 0, estimator: str = "grpo",
                 advantage_params: dict[str, Any] | None = None, num_gpus_per_rank: float = 0):
        import ray

        cls = ray.remote(num_cpus=0, num_gpus=num_gpus_per_rank)(TrainerRank)
        self.ranks = [cls.remote(r, world, torch_threads, estimator, advantage_params) for r in range(world)]

    async def setup(self, actor_fields: dict[str, Any]) -> None:
        master = await self.ranks[0].master_address.remote()
        await self.same("setup", master, actor_fields)

    async def call(self, method: str, *per_rank_args: list[Any], **kwargs: Any) -> list[Any]:
        refs = [getattr(rank, method).remote(*(a[i] for a in per_rank_args), **kwargs)
                for i, rank in enumerate(self.ranks)]
        return [await ref for ref in refs]

    async def same(self, method: str, *args: Any) -> list[Any]:
        return await self.call(method, *([a] * len(self.ranks) for a in args))
