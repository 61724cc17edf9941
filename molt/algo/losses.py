"""Policy losses (registered by name in `POLICY_LOSSES`) and the clipped value loss for the critic.

Design notes and decisions: docs/internals.md, section `molt/algo/losses.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from molt.algo.ops import Registry, as_mask, check_shape, detach_all, masked_mean, seq_mean

POLICY_LOSSES = Registry("policy loss")


def register_policy_loss(name: str) -> Callable:
    """Decorator: `@register_policy_loss("name")` on `fn(logprobs, old_logprobs, advantages, mask, params,
    seq_ids) -> (per_token_loss [N, T], metrics)`; `mask` arrives as a bool tensor."""
    return POLICY_LOSSES.register(name)


@dataclass(slots=True)
class PolicyLossParams:
    eps_low: float = 0.2  # lower clip: ratio >= 1 - eps_low (--actor.eps_clip_low_high LOW HIGH)
    eps_high: float = 0.2  # upper clip: ratio <= 1 + eps_high
    dual_clip: float | None = None  # ppo: bound -c*A on tokens with A < 0; None = off; must be > 1
    entropy_coef: float = 0.0  # entropy bonus weight (--actor.entropy_coef); needs `entropy`
    kl_coef: float = 0.0  # weight of a KL loss term (--algo.kl.init_coef with --algo.kl.use_loss); needs `kl`

    def validate(self) -> PolicyLossParams:
        if not 0.0 <= self.eps_low <= 1.0:
            raise ValueError(f"eps_low must be in [0, 1] (got {self.eps_low})")
        if self.eps_high < 0:
            raise ValueError(f"eps_high must be >= 0 (got {self.eps_high})")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 or None (got {self.dual_clip})")
        if self.entropy_coef < 0 or self.kl_coef < 0:
            raise ValueError(
                f"entropy_coef and kl_coef must be >= 0 (got {self.entropy_coef}, {self.kl_coef})"
            )
        return self


def _clipped_surrogate(
    ratio: Tensor, adv: Tensor, mask: Tensor, params: PolicyLossParams
) -> tuple[Tensor, dict]:
    """max(-r A, -clip(r) A), then the dual clip; metrics over action tokens."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - params.eps_low, 1.0 + params.eps_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {"policy/clip_frac": masked_mean((clipped > unclipped).float(), mask)}
    if params.dual_clip is not None:
        bound = -params.dual_clip * adv
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        metrics["policy/dual_clip_frac"] = masked_mean(dual.float(), mask)
    return torch.where(mask, loss, 0.0), metrics


def _ratio_metrics(log_ratio: Tensor, mask: Tensor) -> dict:
    return {
        "policy/ratio_mean": masked_mean(log_ratio.exp(), mask),
        "policy/approx_kl": masked_mean(0.5 * log_ratio.square(), mask),  # k2 of old vs current
    }


def ppo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    params: PolicyLossParams,
    seq_ids: Tensor | None = None,
    sequence: bool = False,
) -> tuple[Tensor, dict]:
    """Token-level clipped surrogate with asymmetric clip and optional dual clip. [N, T] -> [N, T]. GSPO
    (`sequence`): on the sequence ratio exp(mean_t log r_t), broadcast to the sequence's tokens."""
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0)
    if sequence:
        log_ratio = seq_mean(log_ratio, mask, seq_ids)
    loss, metrics = _clipped_surrogate(log_ratio.exp(), advantages, mask, params)
    return loss, {**metrics, **_ratio_metrics(log_ratio, mask)}


register_policy_loss("ppo")(ppo)
register_policy_loss("gspo")(functools.partial(ppo, sequence=True))


@register_policy_loss("cispo")
def cispo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    params: PolicyLossParams,
    seq_ids: Tensor | None = None,
) -> tuple[Tensor, dict]:
    """-sg(clip(r)) A logprobs: clipped importance weight, gradient on every token. [N, T] -> [N, T]."""
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0).detach()
    ratio = log_ratio.exp()
    weight = ratio.clamp(1.0 - params.eps_low, 1.0 + params.eps_high)
    loss = -weight * advantages * torch.where(mask, logprobs, 0.0)
    clipped = (weight != ratio).float()
    return loss, {"policy/clip_frac": masked_mean(clipped, mask), **_ratio_metrics(log_ratio, mask)}


@register_policy_loss("sft")
def sft(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    params: PolicyLossParams,
    seq_ids: Tensor | None = None,
) -> tuple[Tensor, dict]:
    return torch.where(mask, -logprobs, 0.0), {}


def policy_loss(
    name: str,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    *,
    params: PolicyLossParams | None = None,
    is_weights: Tensor | None = None,
    entropy: Tensor | None = None,
    kl: Tensor | None = None,
    seq_ids: Tensor | None = None,
) -> tuple[Tensor, dict]:
    """Per-token loss [N, T] of the policy loss registered as `name`, with the optional terms:

    is_weights: [N, T] detached importance weights (importance.py), multiply the policy-gradient term.
    entropy: [N, T] per-token entropy of the current policy; adds -entropy_coef * entropy.
    kl: [N, T] per-token KL vs the reference (kl.py, placement "loss"); adds kl_coef * kl.
    seq_ids: [N, T] sequence ids for packed rows (gspo); None = one sequence per row.
    Metrics: the loss's own ("policy/clip_frac", "policy/ratio_mean", "policy/approx_kl", ...) plus
    "policy/pg_loss" (token mean of the weighted policy-gradient term) and "policy/entropy" when given."""
    params = (params or PolicyLossParams()).validate()
    mask = as_mask(action_mask, logprobs)
    for arg, value in (
        ("old_logprobs", old_logprobs),
        ("advantages", advantages),
        ("is_weights", is_weights),
        ("entropy", entropy),
        ("kl", kl),
    ):
        check_shape(arg, value, logprobs.shape)
    advantages = torch.where(mask, advantages, 0.0)  # padding garbage must not reach a gradient (0 * nan)
    loss, metrics = POLICY_LOSSES.get_fn(name)(logprobs, old_logprobs, advantages, mask, params, seq_ids)
    if is_weights is not None:
        loss = loss * torch.where(mask, is_weights.detach(), 0.0)
    metrics["policy/pg_loss"] = masked_mean(loss, mask)
    if params.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy: entropy_coef > 0 needs the per-token entropy")
        loss = loss - params.entropy_coef * torch.where(mask, entropy, 0.0)
    if entropy is not None:
        metrics["policy/entropy"] = masked_mean(entropy, mask)
    if params.kl_coef > 0:
        if kl is None:
            raise ValueError("kl: kl_coef > 0 needs the per-token KL (kl_divergence, placement 'loss')")
        loss = loss + params.kl_coef * torch.where(mask, kl, 0.0)
    return loss, detach_all(metrics)


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, action_mask: Tensor, clip_eps: float | None = 0.2
) -> tuple[Tensor, dict]:
    """Clipped critic loss per token: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2).

    values: [N, T] current critic values (with grad); old_values: [N, T] values when the batch was made;
    returns: [N, T] targets (the gae estimator's `returns`); clip_eps None disables clipping.
    Returns (loss [N, T], 0 off action tokens; metrics "critic/clip_frac", "critic/value_mean",
    "critic/loss")."""
    mask = as_mask(action_mask, values)
    check_shape("old_values", old_values, values.shape)
    check_shape("returns", returns, values.shape)
    if clip_eps is not None and clip_eps < 0:
        raise ValueError(f"clip_eps must be >= 0 or None (got {clip_eps})")
    # zero padding first: garbage there must not reach the gradient of `values`
    values, old_values, returns = (torch.where(mask, x, 0.0) for x in (values, old_values, returns))
    err = (values - returns).square()
    if clip_eps is None:
        loss, clipped = err, torch.zeros_like(mask)
    else:
        v_clip = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
        err_clip = (v_clip - returns).square()
        loss, clipped = torch.maximum(err, err_clip), err_clip > err
    loss = torch.where(mask, 0.5 * loss, 0.0)
    return loss, detach_all(
        {
            "critic/clip_frac": masked_mean(clipped.float(), mask),
            "critic/value_mean": masked_mean(values, mask),
            "critic/loss": masked_mean(loss, mask),
        }
    )
