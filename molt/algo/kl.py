"""KL estimators against a reference policy: k1, k2, k3 (Schulman's approximations), per token.

Design notes and decisions: docs/internals.md, section `molt/algo/kl.py`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from molt.algo.ops import Registry, as_mask, check_shape, detach_all, masked_mean

KL_ESTIMATORS = Registry("kl estimator")
PLACEMENTS = {"loss": ("k2", "k3"), "reward": ("k1", "k2", "k3")}


def register_kl(name: str) -> Callable:
    """Decorator: `@register_kl("name")` on `fn(log_r: Tensor, clamp: float) -> Tensor` (elementwise)."""
    return KL_ESTIMATORS.register(name)


@register_kl("k1")
def k1(log_r: Tensor, clamp: float) -> Tensor:
    return log_r


@register_kl("k2")
def k2(log_r: Tensor, clamp: float) -> Tensor:
    return 0.5 * log_r.square()


@register_kl("k3")
def k3(log_r: Tensor, clamp: float) -> Tensor:
    log_r = log_r.clamp(-clamp, clamp)
    return torch.expm1(-log_r) + log_r


def kl_divergence(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    action_mask: Tensor,
    estimator: str = "k3",
    *,
    placement: str = "loss",
    clamp: float = 20.0,
) -> tuple[Tensor, dict]:
    """Per-token KL estimate of the policy against the reference.

    logprobs: [N, T] the policy's log-probabilities of the sampled tokens (with grad for placement "loss").
    ref_logprobs: [N, T] the reference model's log-probabilities of the same tokens.
    action_mask: [N, T]; the result is 0 off action tokens.
    Returns (kl [N, T], metrics {"kl/mean": mean over action tokens}). Detached for placement "reward"."""
    mask = as_mask(action_mask, logprobs)
    check_shape("ref_logprobs", ref_logprobs, logprobs.shape)
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {sorted(PLACEMENTS)} (got {placement!r})")
    fn = KL_ESTIMATORS.get_fn(estimator)
    if estimator in ("k1", "k2", "k3") and estimator not in PLACEMENTS[placement]:
        raise ValueError(
            f"estimator: {estimator} has zero expected gradient as a loss; use k2 or k3 for "
            "placement 'loss' (k1 belongs in the reward)"
        )
    log_r = torch.where(mask, logprobs - ref_logprobs, 0.0)
    kl = torch.where(mask, fn(log_r, clamp), 0.0)
    if placement == "reward":
        kl = kl.detach()
    return kl, detach_all({"kl/mean": masked_mean(kl, mask)})


def adaptive_kl_coef(coef: float, kl: float, target: float, horizon: int, n_rollouts: int) -> float:
    """The KL coefficient after a step of `n_rollouts` rollouts whose mean KL was `kl`:
    coef * (1 + clip(kl / target - 1, -0.2, 0.2) * n_rollouts / horizon)."""
    if target <= 0 or horizon <= 0:
        raise ValueError(f"algo.kl.target and algo.kl.horizon must be > 0 (got {target}, {horizon})")
    return coef * (1.0 + min(max(kl / target - 1.0, -0.2), 0.2) * n_rollouts / horizon)
