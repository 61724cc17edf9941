"""Importance correction for the training-inference mismatch (and for tokens sampled by older policies).

Design notes and decisions: docs/internals.md, section `molt/algo/importance.py`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from molt.algo.ops import as_mask, check_shape, detach_all, masked_mean, seq_mean, seq_sum

# level -> log of the ratio the rule looks at, per token: (log_r [N, T], mask, seq_ids) -> [N, T]
LEVELS = {"token": lambda log_r, mask, seq_ids: log_r, "seq": seq_sum, "geo": seq_mean}


def _gate(lr: Tensor, kept: Tensor, lo: float, hi: float) -> tuple[Tensor, Tensor]:
    """Weight exp(kept) inside the band, exp(-inf) = 0 outside."""
    inside = (lr >= lo) & (lr <= hi)
    return torch.where(inside, kept, -math.inf).exp(), inside


# mode -> (weight, retained) from the level's log-ratio `lr`, the token log-ratio `tok` and the log band [lo, hi]
MODES = {
    "mask": lambda lr, tok, lo, hi: _gate(lr, tok, lo, hi),  # the token's own ratio
    "mis": lambda lr, tok, lo, hi: _gate(lr, lr, lo, hi),  # the level's ratio
    "clip": lambda lr, tok, lo, hi: (lr.clamp(lo, hi).exp(), (lr >= lo) & (lr <= hi)),
    "trunc": lambda lr, tok, lo, hi: (lr.clamp(max=hi).exp(), lr <= hi),
}
GATES = ("mask", "mis")  # the modes that reject (weight 0) what falls outside the band


def importance_weights(
    trainer_logprobs: Tensor,
    behavior_logprobs: Tensor,
    action_mask: Tensor,
    level: str = "token",
    mode: str = "mask",
    low: float = 0.5,
    high: float = 2.0,
    seq_ids: Tensor | None = None,
) -> tuple[Tensor, dict]:
    """Per-token importance weights for the policy-gradient term.

    trainer_logprobs: [N, T] the trainer's log-probabilities of the sampled tokens (any grad is dropped);
    behavior_logprobs: [N, T] those recorded at sampling time (`Segment.behavior_logprobs`);
    action_mask: [N, T]; seq_ids: optional [N, T] sequence ids for packed rows.
    Returns (weights [N, T] detached, 1 off action tokens; metrics "is/retained_frac" (1 for an empty mask),
    "is/logprob_gap" (mean |trainer - behavior| over action tokens), "is/weight_mean", and for a gate (mask, mis)
    "is/rejected_frac", the fraction of action tokens it gave weight 0)."""
    mask = as_mask(action_mask, trainer_logprobs)
    check_shape("behavior_logprobs", behavior_logprobs, trainer_logprobs.shape)
    if level != "off" and level not in LEVELS:
        raise ValueError(f"level must be one of {['off', *LEVELS]} (got {level!r})")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)} (got {mode!r})")
    if not 0.0 <= low <= high:
        raise ValueError(f"low and high must satisfy 0 <= low <= high (got low={low}, high={high})")
    log_r = torch.where(mask, trainer_logprobs.detach().double() - behavior_logprobs.double(), 0.0)
    if level == "off":
        weights, retained = torch.ones_like(log_r), torch.ones_like(mask)
    else:
        log_band = [math.log(b) if b > 0 else -math.inf for b in (low, high)]
        weights, retained = MODES[mode](LEVELS[level](log_r, mask, seq_ids), log_r, *log_band)
    weights = torch.where(mask, weights, 1.0)
    # an empty mask retains everything; torch.where rather than `if mask.any()` avoids a device sync
    retained_frac = torch.where(mask.sum() > 0, masked_mean(retained.double(), mask), 1.0)
    metrics = {
        "is/retained_frac": retained_frac,
        "is/logprob_gap": masked_mean(log_r.abs(), mask),
        "is/weight_mean": masked_mean(weights, mask),
    }
    if level != "off" and mode in GATES:
        metrics["is/rejected_frac"] = 1.0 - retained_frac
    return weights.to(trainer_logprobs.dtype), detach_all(metrics)
