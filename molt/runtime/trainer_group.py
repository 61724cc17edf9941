"""The trainer group: FSDP2 ranks as Ray actors sharing one torch.distributed group (gloo on CPU, NCCL on GPU).

Design notes and decisions: docs/internals.md, section `molt/runtime/trainer_group.py`.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections import Counter, defaultdict
from typing import Any

import numpy as np

from molt.types import Experience, expand_actions


def credit_rows(groups: list[Any], low: float, high: float) -> list[tuple[tuple, str, float]]:
    """(credit, group, reward) rows of complete groups, each reward clamped into [low, high]: one per rollout and
    role, so that advantages are normalised within a prompt's group and a role (docs/algo.md, "Several
    agents"); a role without a reward of its own gets the rollout's (broadcast). In a group where a rollout
    gave turn rewards, one per rollout, role and turn instead: the role's return from that turn on (the sum of
    its turn rewards there and after; a rollout without any has its reward on every turn), grouped by the
    role's turn number (docs/algo.md, "Per-turn rewards")."""
    rows = []
    for g in groups:
        by_turn = any(o.turn_rewards for o in g.outcomes)
        for o in g.outcomes:
            for role in sorted({e.role for e in o.experiences}) or [""]:
                if not by_turn:
                    rows.append(((o.rollout_id, role), f"{g.group_id}/{role}", o.reward_of(role)))
                    continue
                turns = sorted({t for e in o.experiences if e.role == role for t, _ in e.turns})
                for j, turn in enumerate(turns):
                    rest = sum(o.turn_rewards.get(t, 0.0) for t in turns[j:])
                    ret = (
                        rest if o.turn_rewards else o.reward_of(role)
                    )  # none given: its reward on every turn
                    rows.append(((o.rollout_id, role, turn), f"{g.group_id}/{role}/{j}", ret))
    return [(credit, group, min(max(r, low), high)) for credit, group, r in rows]


def running_baselines(
    groups: list[Any], rows: list[Any], baselines: dict[str, float], decay: float = 0.95
) -> Any:
    """`role_baseline`'s parameters for `credit_rows(groups)`: each row's baseline, the running mean of its
    (environment, role)'s rewards before this step (0 at first); then each baseline moves to
    decay * b + (1 - decay) * the step's mean reward of its (environment, role) (SPIRAL: decay 0.95)."""
    import statistics

    import torch

    from molt.algo import AdvantageParams

    envs = {o.rollout_id: g.row.get("env", "") for g in groups for o in g.outcomes}
    keys = [f"{envs[credit[0]]}/{credit[1]}" for credit, _, _ in rows]
    params = AdvantageParams(
        baselines=torch.tensor([baselines.get(k, 0.0) for k in keys], dtype=torch.float64)
    )
    for key in set(keys):
        mean = statistics.fmean(r for k, (_, _, r) in zip(keys, rows) if k == key)
        baselines[key] = decay * baselines.get(key, 0.0) + (1 - decay) * mean
    return params


def rollout_advantages(
    estimator: str, rollouts: list[tuple[Any, str, float]], params: Any = None
) -> dict[Any, float]:
    """{credit: advantage} for a group estimator, from (credit, group_id, reward) rows (a credit is a rollout
    and a role: `Experience.credit`)."""
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


def terminal_rewards(centred: bool, rollouts: list[tuple[Any, str, float]]) -> dict[Any, float]:
    """{credit: reward a token estimator starts from}: minus its group's mean for the estimators that declare
    `centred` (reinforce_baseline, on_policy_distill), subtracted here, where whole groups are known."""
    if centred:
        return rollout_advantages("dr_grpo", rollouts)  # r - group mean
    return {rid: r for rid, _, r in rollouts}


class TrainerRank:
    def __init__(self, rank: int, world: int, torch_threads: int = 0):
        self.rank, self.world, self.torch_threads = rank, world, torch_threads
        self.actor: Any = None
        self.critic: Any = None

    def master_address(self) -> str:
        """Called on rank 0: its node's address and a free port for the process group rendezvous."""
        import ray

        return f"{ray.util.get_node_ip_address()}:{_free_port()}"

    def setup(self, master: str, cfg: Any) -> None:
        """cfg: the run's resolved `molt.config.MoltConfig`, model paths resolved to local checkpoints."""
        import ray

        addr, port = master.rsplit(":", 1)
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world),
            LOCAL_RANK="0",
            MASTER_ADDR=addr,
            MASTER_PORT=port,
        )
        if "GLOO_SOCKET_IFNAME" not in os.environ:
            ifname = _interface_of(ray.util.get_node_ip_address())
            if ifname:  # else gloo takes the hostname's address, or loopback
                os.environ["GLOO_SOCKET_IFNAME"] = ifname
        import torch

        from molt.algo import estimator_spec, import_files
        from molt.trainer import Actor, Critic

        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        # the user's estimators and losses, registered here too
        import_files(cfg.algo.plugins, "algo.plugins")
        self.cfg, self.spec = cfg, estimator_spec(cfg.algo.advantage.estimator)
        self.actor = Actor(cfg)
        # the KL as a token reward (token-level estimators, `algo.kl.use_loss` false): its coefficient, adapted
        # by the controller like the loss's, and the last window's metrics for the step line
        self.kl_reward_coef = 0.0 if cfg.algo.kl.use_loss else cfg.algo.kl.init_coef
        self.kl_metrics: dict[str, float] = {}
        if self.spec.critic:
            self.critic = Critic(cfg)

    def train_step(
        self,
        windows: list[list[Experience]],
        advantages: dict[Any, float] | None,
        rewards: dict[Any, float] | None = None,
        *,
        epochs: int = 1,
        critic_epochs: int = 1,
        train_actor: bool = True,
    ) -> dict[str, float]:
        """windows: this rank's share of each optimizer window of the step (the same number on every rank);
        advantages: per rollout (group estimators); else rewards: terminal reward per rollout (rank-level)."""
        exps = _reload([e for w in windows for e in w])
        values = returns = []
        if advantages is not None:  # one number per rollout, laid out per token in collation
            for exp in exps:
                exp.advantages = exp.credited(advantages)
        else:
            values, returns = self._rank_advantages(exps, rewards or {})  # collective: every rank calls
        steps = [(self.actor, w) for w in windows] * (epochs if train_actor else 0)
        old = None
        if len(steps) > 1:  # the proximal policy of every step: the policy before the first one
            old = dict(zip(map(id, exps), self.actor.compute_logprobs(exps)))
        if self.critic is not None:
            steps += [(self.critic, w) for w in windows] * critic_epochs
            targets = {id(e): (r, v) for e, r, v in zip(exps, returns, values)}
        count, sums = Counter(model for model, _ in steps), defaultdict(float)
        for model, w in steps:
            if model is self.actor:
                metrics = model.train_step(w, [old[id(e)] for e in w] if old else None)
            else:
                metrics = model.train_step(w, [targets[id(e)][0] for e in w], [targets[id(e)][1] for e in w])
            for key, value in metrics.items():  # means over the steps; times and skipped steps add up
                adds_up = key.startswith(("timing/", "train/skipped_steps"))
                sums[key] += value if adds_up else value / count[model]
        streak = max(m.skipped_in_a_row for m in (self.actor, self.critic) if m is not None)
        return {**sums, **self.kl_metrics, "train/skipped_in_a_row": float(streak)}

    def set_kl_coef(self, coef: float) -> None:
        """The adaptive KL controller's new coefficient (`molt.algo.adaptive_kl_coef`)."""
        if self.cfg.algo.kl.use_loss:
            self.actor.loss_params.kl_coef = coef
        else:
            self.kl_reward_coef = coef

    def advantages(self, experiences: list[Experience], rewards: dict[Any, float]) -> list:
        """What `train_step` trains a rank-level estimator's experiences with (collective; for inspection)."""
        self._rank_advantages(_reload(experiences), rewards)
        return [exp.advantages for exp in experiences]

    def logprobs(self, experiences: list[Experience]) -> list:
        """The policy's per-token log-probs (collective; the trainer column of trajectory dumps)."""
        return self.actor.compute_logprobs(_reload(experiences))

    def _rank_advantages(self, experiences: list[Experience], rewards: dict[Any, float]) -> tuple[list, list]:
        """Token-level estimator on this rank's rollouts, unwhitened, then whitened over the whole window.
        Returns the critic's (values, returns) for gae."""
        import torch

        from molt.algo import AdvantageBatch, AdvantageParams, compute_advantages
        from molt.trainer.batching import pad_rows

        values = self.critic.compute_values(experiences) if self.critic is not None else []
        # KL reward: behavior (sampling-time) log-probs against the reference's, per action token (collective)
        ref = self.actor.compute_logprobs(experiences, reference=True) if self.kl_reward_coef > 0 else []
        a = self.cfg.algo.advantage
        # whitened below, over every rank; centred (a spec's `centred`) by the controller
        params = AdvantageParams(
            gamma=a.gamma,
            lam=a.lam,
            kl_coef=self.kl_reward_coef,
            whiten=False,
            reward_coef=a.reward_coef,
            centred=self.spec.centred,
        )
        adv = mask = None
        returns: list = []
        if experiences:
            length = max(e.num_tokens for e in experiences)
            extra = {"values": pad_rows(values, 0.0, np.float32, length)} if values else {}
            batch = AdvantageBatch.from_experiences(experiences, **extra)
            if ref:
                from molt.algo import kl_divergence

                behavior = [expand_actions(e.behavior_logprobs, e.action_mask, 0.0) for e in experiences]
                batch.kl, kl_metrics = kl_divergence(
                    *(pad_rows(x, 0.0, np.float32, length) for x in (behavior, ref)),
                    batch.action_mask,
                    self.cfg.algo.kl.estimator,
                    placement="reward",
                )
                self.kl_metrics = {k: float(v) for k, v in kl_metrics.items()} | {
                    "kl_coef": self.kl_reward_coef
                }
            batch.rewards = torch.tensor([rewards.get(e.credit, float(e.reward)) for e in experiences])
            result = compute_advantages(a.estimator, batch, params)
            adv, mask = result.advantages.double(), batch.action_mask
            if result.returns is not None:
                returns = [
                    result.returns[i, : e.num_tokens].float().numpy() for i, e in enumerate(experiences)
                ]
        if not a.no_whiten:
            adv = self._whiten(adv, mask)
        for i, exp in enumerate(experiences):
            exp.advantages = adv[i, : exp.num_tokens].float().numpy()
        return values, returns

    def _whiten(self, adv: Any, mask: Any) -> Any:
        """(adv - mean) / std over the action tokens of every data-parallel rank (one all-reduce of three
        numbers)."""
        import torch

        from molt.trainer import parallel

        stats = torch.zeros(3, dtype=torch.float64)
        if adv is not None:
            picked = adv[mask]
            stats = torch.stack([picked.sum(), (picked**2).sum(), torch.tensor(float(picked.numel()))])
        # over the data-parallel ranks only (tensor-parallel peers hold the same rollouts)
        stats = parallel.all_reduce_sum(stats.to(self.actor.device), self.actor.mesh).cpu()
        if adv is None:
            return None
        total, squares, count = stats.tolist()
        mean = total / max(count, 1.0)
        var = max(squares / max(count, 1.0) - mean * mean, 0.0)
        return torch.where(mask, (adv - mean) / (var + 1e-8) ** 0.5, 0.0)  # as molt.algo's masked_whiten

    def weight_refs(self, bucket_bytes: int) -> list[Any]:
        """Stream full weights bucket by bucket into the object store (collective: every rank gathers each
        bucket, rank 0 puts it)."""
        import ray

        from molt.engine.base import pack_weights

        return [
            ray.put(pack_weights(bucket))
            for bucket in self.actor.iter_weights(bucket_bytes)
            if self.rank == 0
        ]

    def weight_plan(self, bucket_bytes: int) -> list[list[tuple]]:
        return self.actor.weight_plan(bucket_bytes)

    def join_weight_group(self, address: str, world: int) -> None:
        """Rank 0 becomes rank 0 (the sender) of the collective refit group; other ranks take no part."""
        from molt.engine.weight_group import WeightGroup

        if self.rank == 0:
            self.weight_group = WeightGroup(address, 0, world, self.actor.device)

    def broadcast_weights(self, bucket_bytes: int) -> None:
        """Stream full weights bucket by bucket over the refit group (collective over the trainer: every rank
        gathers, rank 0 sends)."""
        for bucket in self.actor.iter_weights(bucket_bytes, device=self.actor.device):
            if self.rank == 0:
                self.weight_group.send(bucket)

    def save(self, path: str) -> None:
        self.actor.save(path)
        if self.critic is not None:
            self.critic.save(path + "-critic")

    def load(self, path: str) -> None:
        self.actor.load(path)
        if self.critic is not None:
            self.critic.load(path + "-critic")

    def export_hf(self, path: str) -> None:
        self.actor.export_hf(path)


def _reload(experiences: list[Experience]) -> list[Experience]:
    for exp in experiences:
        if exp.offloaded:
            exp.reload()
    return experiences


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _interface_of(ip: str) -> str | None:
    """The network interface that holds address `ip`, for gloo: a rank on another node must reach it there, not at
    the address this host's name resolves to (none, in a network namespace; 127.0.1.1 on Debian)."""
    import psutil

    return next(
        (name for name, addrs in psutil.net_if_addrs().items() if any(a.address == ip for a in addrs)), None
    )


def thread_options(threads: int) -> dict[str, Any]:
    """Ray actor options that give a trainer rank `threads` OpenMP threads. Ray sets OMP_NUM_THREADS=1 in
    actors that reserve no CPU, and torch.set_num_threads alone does not lift it for every kernel: a 2-thread
    policy update took 7.8 s in such an actor, 6.2 s with OMP_NUM_THREADS=2 (6.1 s in a plain process). Rollout
    workers keep Ray's setting: 16 x 48 tokens of generation measured 7.5 s with it and 8.0 s with 2."""
    if threads <= 0:
        return {}
    return {"runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}}}


def spread(i: int, count: int, gpus: float) -> dict[str, Any]:
    """Ray actor options that pin the i-th of `count` actors that reserve nothing to alive node i * nodes // count,
    the driver's node first: Ray's SPREAD, or a soft affinity, often put them on one node (docs/internals.md).
    {} on one node, and for actors that reserve GPUs: Ray's resource accounting places those."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    nodes = sorted((n["NodeID"] for n in ray.nodes() if n["Alive"]), key=lambda n: (n != here, n))
    if len(nodes) < 2 or gpus:
        return {}
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(nodes[i * len(nodes) // count], soft=False)}


class TrainerGroup:
    """Creates the rank actors and calls them collectively."""

    def __init__(self, world: int, *, torch_threads: int = 0, num_gpus_per_rank: float = 0):
        import ray

        cls = ray.remote(num_cpus=0, num_gpus=num_gpus_per_rank)(TrainerRank)
        options = [
            {**thread_options(torch_threads), **spread(r, world, num_gpus_per_rank)} for r in range(world)
        ]
        self.ranks = [cls.options(**options[r]).remote(r, world, torch_threads) for r in range(world)]

    async def setup(self, cfg: Any) -> None:
        master = await self.ranks[0].master_address.remote()
        await self.same("setup", master, cfg)

    async def call(self, method: str, *per_rank_args: list[Any], **kwargs: Any) -> list[Any]:
        """Every rank's result; the first rank to fail (an exception, a dead actor) raises at once, naming itself:
        the other ranks may wait in a collective for it forever."""
        futures = [
            asyncio.ensure_future(getattr(rank, method).remote(*(a[i] for a in per_rank_args), **kwargs))
            for i, rank in enumerate(self.ranks)
        ]
        await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
        for rank, f in enumerate(futures):
            error = f.exception() if f.done() else None
            if error is not None:
                cause = error.cause if isinstance(getattr(error, "cause", None), BaseException) else error
                reason = (str(cause).strip().splitlines() or [""])[0]  # a Ray error's first line
                raise RuntimeError(
                    f"trainer rank {rank} failed in {method}: {type(cause).__name__}: {reason}"
                ) from error
        return [f.result() for f in futures]

    async def same(self, method: str, *args: Any) -> list[Any]:
        return await self.call(method, *([a] * len(self.ranks) for a in args))
