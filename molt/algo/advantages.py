"""Advantage estimators, selected by name from the `ESTIMATORS` registry.

Design notes and decisions: docs/internals.md, section `molt/algo/advantages.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from molt.algo.ops import (
    Registry,
    as_mask,
    check_shape,
    discounted_reverse_cumsum,
    masked_whiten,
)
from molt.types import Experience

ESTIMATORS = Registry("advantage estimator")
KINDS = ("group", "token")


@dataclass(frozen=True, slots=True)
class EstimatorSpec:
    """How a run computes an estimator (`molt.runtime.trainer_group`), as its registration declares it."""

    # group: one advantage per rollout from its group's rewards, by the controller; token: per token on the
    # trainer ranks, each over its own rollouts (KL rewards, critic values)
    kind: str
    # token: the controller subtracts each rollout's group mean from its reward (a group may span ranks) and
    # the ranks run the estimator with `AdvantageParams.centred`
    centred: bool = False
    critic: bool = False  # token: needs critic values (a run builds a critic)


SPECS: dict[str, EstimatorSpec] = {}


def register_estimator(name: str, kind: str, *, centred: bool = False, critic: bool = False) -> Callable:
    """Decorator: `@register_estimator("name", "group")` on `fn(batch: AdvantageBatch, params: AdvantageParams) ->
    AdvantageResult` makes it selectable as `--algo.advantage.estimator name`; `kind` and the flags: EstimatorSpec."""
    if kind not in KINDS or (kind == "group" and (centred or critic)):
        raise ValueError(f"kind must be one of {KINDS} (centred and critic: token only), got {kind!r}")
    register = ESTIMATORS.register(name)

    def deco(fn: Callable) -> Callable:
        register(fn)  # refuses a name another function took
        SPECS[name] = EstimatorSpec(kind, centred, critic)
        return fn

    return deco


def estimator_spec(name: str) -> EstimatorSpec:
    """The registered estimator's spec; an unknown name raises ValueError listing the known ones."""
    ESTIMATORS.get_fn(name)
    return SPECS[name]


@dataclass(slots=True)
class AdvantageParams:
    gamma: float = 1.0  # discount over a rollout's action tokens (reinforce, reinforce_baseline, gae)
    lam: float = 1.0  # GAE lambda
    kl_coef: float = 0.0  # weight of the KL token reward (token-level estimators); 0 = off
    whiten: bool = True  # global whitening over action tokens (reinforce, reinforce_baseline, gae)
    std_eps: float = 1e-6  # grpo: (r - mean) / (std + std_eps)
    reward_coef: float = 0.0  # on_policy_distill: weight of the reward next to the teacher's KL
    centred: bool = False  # rewards are already minus their group's mean (reinforce_baseline skips its own)
    baselines: Tensor | None = (
        None  # role_baseline: [N] the running baseline of each row's (environment, role)
    )

    def validate(self) -> AdvantageParams:
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1] (got {getattr(self, name)})")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0 (got {self.kl_coef})")
        if self.std_eps <= 0:
            raise ValueError(f"std_eps must be > 0 (got {self.std_eps})")
        return self


def _dense_ids(keys: list[str]) -> Tensor:
    """String ids -> integers 0..K-1 in order of first appearance."""
    index = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    return torch.tensor([index[k] for k in keys], dtype=torch.long)


@dataclass(slots=True)
class AdvantageBatch:
    """Segments of complete rollouts, one per row. Shapes: N rows, T padded length."""

    rewards: Tensor  # [N] float: the rollout's reward, repeated on every segment row of that rollout
    group_ids: Tensor  # [N] int: prompt group of the row's rollout (any integers)
    rollout_ids: Tensor  # [N] int: rollout of the row; the segments of one rollout share it
    action_mask: Tensor  # [N, T] bool or 0/1: tokens the policy sampled
    segment_index: Tensor | None = None  # [N] int: order of the row within its rollout; None = row order
    kl: Tensor | None = None  # [N, T] detached per-token KL vs the reference (reward placement, see kl.py)
    values: Tensor | None = None  # [N, T] critic value of the state in which token t was sampled (gae)

    def __post_init__(self) -> None:
        self.action_mask = as_mask(self.action_mask)
        n, t = self.action_mask.shape
        for name in ("rewards", "group_ids", "rollout_ids", "segment_index"):
            check_shape(name, getattr(self, name), (n,))
        check_shape("kl", self.kl, (n, t))
        check_shape("values", self.values, (n, t))
        if not self.rewards.is_floating_point():
            self.rewards = self.rewards.float()  # integer rewards would make integer advantages
        if not torch.isfinite(self.rewards).all():
            raise ValueError("rewards must be finite")

    @classmethod
    def from_experiences(cls, exps: Sequence[Experience], **tensors: Tensor) -> AdvantageBatch:
        """Pad reloaded experiences into a batch (string ids become integers). `tensors` may give `kl` or
        `values` in the same [N, T] layout."""
        if any(e.action_mask is None for e in exps):
            raise ValueError("exps: every experience must be reloaded (action_mask is None when offloaded)")
        mask = torch.zeros(len(exps), max((len(e.action_mask) for e in exps), default=0), dtype=torch.bool)
        for i, e in enumerate(exps):
            mask[i, : len(e.action_mask)] = torch.tensor(e.action_mask, dtype=torch.bool)
        return cls(
            rewards=torch.tensor([float(e.reward) for e in exps]),
            group_ids=_dense_ids([e.group_id for e in exps]),
            rollout_ids=_dense_ids([e.rollout_id for e in exps]),
            segment_index=torch.tensor([e.segment_index for e in exps], dtype=torch.long),
            action_mask=mask,
            **tensors,
        )


@dataclass(slots=True)
class AdvantageResult:
    advantages: Tensor  # [N, T], 0 off action tokens
    # [N, T] unwhitened returns (gae: the critic's targets); None for group ones
    returns: Tensor | None = None


@dataclass(slots=True)
class RolloutStats:
    """Per-rollout view of a batch (R rollouts, G groups), each rollout counted once."""

    row_rollout: Tensor  # [N] long: dense rollout index (0..R-1) of each row
    reward: Tensor  # [R] float64: the rollout's reward
    group: Tensor  # [R] long: dense group index (0..G-1) of each rollout
    group_mean: Tensor  # [R] float64: mean reward of the rollout's group
    group_std: Tensor  # [R] float64: unbiased std of the group's rewards; 0 for a group of one
    group_size: Tensor  # [R] float64: number of rollouts in the group


def _per_rollout(values: Tensor, row_rollout: Tensor, num: int, name: str) -> Tensor:
    """Collapse a per-row value to one per rollout; ValueError when a rollout's rows disagree."""
    v = values.double()
    hi, lo = (
        torch.full((num,), fill, dtype=v.dtype, device=v.device).scatter_reduce(0, row_rollout, v, how)
        for fill, how in ((-torch.inf, "amax"), (torch.inf, "amin"))
    )
    if (hi != lo).any():
        raise ValueError(f"{name} must be equal on all segment rows of a rollout")
    return hi


def rollout_stats(batch: AdvantageBatch) -> RolloutStats:
    """Deduplicate rows by rollout id and compute group mean/std/size over rollouts."""
    _, row_rollout = torch.unique(batch.rollout_ids, return_inverse=True)
    num = int(row_rollout.max()) + 1 if row_rollout.numel() else 0
    reward = _per_rollout(batch.rewards, row_rollout, num, "rewards")
    _, row_group = torch.unique(batch.group_ids, return_inverse=True)
    group = _per_rollout(row_group, row_rollout, num, "group_ids").long()
    zeros = torch.zeros(int(group.max()) + 1 if num else 0, dtype=torch.float64, device=reward.device)
    size = zeros.index_add(0, group, torch.ones_like(reward))
    mean = zeros.index_add(0, group, reward) / size.clamp(min=1)
    var = zeros.index_add(0, group, (reward - mean[group]) ** 2) / (size - 1).clamp(min=1)
    return RolloutStats(row_rollout, reward, group, mean[group], var.sqrt()[group], size[group])


def to_tokens(per_rollout: Tensor, stats: RolloutStats, batch: AdvantageBatch) -> Tensor:
    """Give each rollout's value [R] to every action token of all its segments: [N, T] (0 elsewhere)."""
    rows = per_rollout[stats.row_rollout].to(batch.rewards.dtype)[:, None]
    return torch.where(batch.action_mask, rows, 0.0)


@dataclass(slots=True)
class ActionSequences:
    """Each rollout's action tokens laid out as one sequence [R, L], its segments in order."""

    rows: Tensor  # [M] row of each action token of the batch (M action tokens)
    cols: Tensor  # [M] column of each action token
    rollout: Tensor  # [M] rollout index of each action token
    pos: Tensor  # [M] position of the token in its rollout's action sequence
    length: Tensor  # [R] number of action tokens of each rollout

    @classmethod
    def build(cls, batch: AdvantageBatch, stats: RolloutStats) -> ActionSequences:
        mask, row_r = batch.action_mask, stats.row_rollout
        seg = batch.segment_index
        seg = torch.arange(len(row_r), device=mask.device) if seg is None else seg
        order = torch.argsort(seg, stable=True)
        order = order[torch.argsort(row_r[order], stable=True)]  # by rollout, then by segment index
        same = (row_r[order][1:] == row_r[order][:-1]) & (seg[order][1:] == seg[order][:-1])
        if same.any():
            raise ValueError("segment_index must be distinct among the rows of one rollout")
        counts = mask.sum(1)
        excl = counts[order].cumsum(0) - counts[order]  # action tokens before each row, in sorted order
        num = len(stats.reward)
        start = excl.new_zeros(num).scatter_reduce(0, row_r[order], excl, "amin", include_self=False)
        row_offset = torch.empty_like(counts)
        row_offset[order] = excl - start[row_r[order]]
        rows, cols = mask.nonzero(as_tuple=True)
        pos = row_offset[rows] + (mask.cumsum(1) - 1)[rows, cols]
        length = counts.new_zeros(num).index_add(0, row_r, counts)
        return cls(rows, cols, row_r[rows], pos, length)

    def zeros(self) -> Tensor:
        """[R, L] float64 zeros, L the longest rollout's action count."""
        width = int(self.length.max()) if len(self.length) else 0
        return torch.zeros(len(self.length), width, dtype=torch.float64, device=self.length.device)

    def gather(self, x: Tensor) -> Tensor:
        """[N, T] -> [R, L] float64, zero beyond each rollout's length."""
        out = self.zeros()
        out[self.rollout, self.pos] = x[self.rows, self.cols].double()
        return out

    def scatter(self, y: Tensor, like: Tensor) -> Tensor:
        """[R, L] -> [N, T] shaped and typed like `like`, zero off action tokens."""
        out = torch.zeros_like(like)
        out[self.rows, self.cols] = y[self.rollout, self.pos].to(like.dtype)
        return out

    def token_rewards(self, terminal: Tensor, batch: AdvantageBatch, params: AdvantageParams) -> Tensor:
        """[R, L]: -kl_coef * kl on every action token plus `terminal` [R] on each rollout's last one."""
        rew = self.zeros()
        if params.kl_coef > 0:
            if batch.kl is None:
                raise ValueError("kl: kl_coef > 0 needs the per-token KL in the batch")
            rew = rew - params.kl_coef * self.gather(batch.kl)
        has = (self.length > 0).nonzero(as_tuple=True)[0]
        rew[has, self.length[has] - 1] += terminal[has]
        return rew


def _float_like(batch: AdvantageBatch) -> Tensor:
    return torch.zeros(batch.action_mask.shape, dtype=batch.rewards.dtype, device=batch.action_mask.device)


def reinforce(batch: AdvantageBatch, params: AdvantageParams, baseline: bool = False) -> AdvantageResult:
    """REINFORCE++: discounted token returns (KL penalty as token reward), globally whitened. REINFORCE++-baseline
    (`baseline`): the same with the group mean subtracted from each rollout's reward."""
    stats = rollout_stats(batch)
    seqs = ActionSequences.build(batch, stats)
    terminal = stats.reward - stats.group_mean if baseline and not params.centred else stats.reward
    returns = seqs.scatter(
        discounted_reverse_cumsum(seqs.token_rewards(terminal, batch, params), params.gamma),
        _float_like(batch),
    )
    adv = masked_whiten(returns, batch.action_mask) if params.whiten else returns
    return AdvantageResult(adv, returns)


register_estimator("reinforce", "token")(reinforce)
register_estimator("reinforce_baseline", "token", centred=True)(functools.partial(reinforce, baseline=True))


@register_estimator("gae", "token", critic=True)
def gae(batch: AdvantageBatch, params: AdvantageParams) -> AdvantageResult:
    """GAE over each rollout's action sequence: delta_k = r_k + gamma V_{k+1} - V_k (V = 0 past the end),
    A_k = sum_j (gamma lam)^j delta_{k+j}; returns = A + V (unwhitened); advantages whitened."""
    if batch.values is None:
        raise ValueError("values: the gae estimator needs critic values in the batch")
    stats = rollout_stats(batch)
    seqs = ActionSequences.build(batch, stats)
    v = seqs.gather(batch.values)
    v_next = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1)
    delta = seqs.token_rewards(stats.reward, batch, params) + params.gamma * v_next - v
    raw = discounted_reverse_cumsum(delta, params.gamma * params.lam)
    like = _float_like(batch)
    adv = seqs.scatter(raw, like)
    returns = seqs.scatter(raw + v, like)
    return AdvantageResult(masked_whiten(adv, batch.action_mask) if params.whiten else adv, returns)


@register_estimator("on_policy_distill", "token", centred=True)
def on_policy_distill(batch: AdvantageBatch, params: AdvantageParams) -> AdvantageResult:
    """Per-token reverse KL to the teacher as the advantage (see the module docstring)."""
    if batch.kl is None and params.kl_coef > 0:
        raise ValueError("kl: on_policy_distill needs the per-token KL to the teacher in the batch")
    s, kl = rollout_stats(batch), 0.0 if batch.kl is None else batch.kl
    adv = params.reward_coef * to_tokens(s.reward, s, batch) - params.kl_coef * kl
    return AdvantageResult(torch.where(batch.action_mask, adv, 0.0))


def _group_result(batch: AdvantageBatch, per_rollout: Callable[[RolloutStats], Tensor]) -> AdvantageResult:
    """The advantage `per_rollout(stats)` [R] of each rollout on its action tokens; 0 in a group of one (no
    baseline)."""
    s = rollout_stats(batch)
    return AdvantageResult(to_tokens(torch.where(s.group_size < 2, 0.0, per_rollout(s)), s, batch))


@register_estimator("grpo", "group")
def grpo(batch: AdvantageBatch, params: AdvantageParams) -> AdvantageResult:
    """(r - group mean) / (group std + std_eps), one value per rollout."""
    return _group_result(batch, lambda s: (s.reward - s.group_mean) / (s.group_std + params.std_eps))


@register_estimator("dr_grpo", "group")
def dr_grpo(batch: AdvantageBatch, params: AdvantageParams) -> AdvantageResult:
    """Dr. GRPO: r - group mean, no std normalization."""
    return _group_result(batch, lambda s: s.reward - s.group_mean)


@register_estimator("rloo", "group")
def rloo(batch: AdvantageBatch, params: AdvantageParams) -> AdvantageResult:
    """RLOO: r - mean of the other rollouts of the group = n / (n - 1) * (r - group mean)."""
    return _group_result(
        batch, lambda s: (s.reward - s.group_mean) * s.group_size / (s.group_size - 1).clamp(min=1)
    )


@register_estimator("role_baseline", "group")
def role_baseline(batch: AdvantageBatch, params: AdvantageParams) -> AdvantageResult:
    """SPIRAL's role-conditioned advantage: r - b, with b a running mean of the rewards of the row's
    (environment, role) that the controller keeps across steps (`params.baselines`; docs/algo.md)."""
    if params.baselines is None:
        raise ValueError("role_baseline needs the baselines of the batch's rows (AdvantageParams.baselines)")
    adv = batch.rewards.double() - params.baselines.double()
    return AdvantageResult(torch.where(batch.action_mask, adv[:, None], 0.0))


def compute_advantages(
    name: str, batch: AdvantageBatch, params: AdvantageParams | None = None
) -> AdvantageResult:
    """Run the estimator registered as `name` on `batch`, checking what it returns."""
    params, fn = (params or AdvantageParams()).validate(), ESTIMATORS.get_fn(name)
    if SPECS[name].kind == "group" and params.kl_coef > 0:  # one reward per rollout, no token rewards
        raise ValueError(
            f"kl_coef: {name} takes no KL token reward; put KL in the loss (kl placement 'loss')"
        )
    result = fn(batch, params)
    if result.advantages.shape != batch.action_mask.shape:
        raise ValueError(
            f"estimator {name!r} returned advantages of shape {tuple(result.advantages.shape)}, "
            f"expected {tuple(batch.action_mask.shape)}"
        )
    return result
