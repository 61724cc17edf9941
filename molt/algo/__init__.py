"""Molt's RL algorithms as pure functions on tensors: advantage estimators, KL, policy and value losses,
importance correction, window normalization and group filters. Imports only torch and molt.types.

One optimizer step of the trainer, in order (all per-token tensors [N, T], aligned with token_ids):

    adv = compute_advantages("grpo", AdvantageBatch(...)).advantages          # once per training batch
    w, m = importance_weights(old_logprobs, behavior_logprobs, mask, "token", "mask", 0.5, 5.0)
    kl, m = kl_divergence(logprobs, ref_logprobs, mask, "k3", placement="loss")
    tok, m = policy_loss("ppo", logprobs, old_logprobs, adv, mask, params=..., is_weights=w, kl=kl)
    loss, m = window_normalize(tok, mask, global_count, dp_size=world)       # then loss.backward()

Variants are chosen by name from the registries ESTIMATORS, POLICY_LOSSES, KL_ESTIMATORS; add one with
`register_estimator`, `register_policy_loss` or `register_kl` (see docs/algo.md).
"""

from molt.algo.advantages import (
    ESTIMATORS,
    ActionSequences,
    AdvantageBatch,
    AdvantageParams,
    AdvantageResult,
    RolloutStats,
    compute_advantages,
    estimator_spec,
    register_estimator,
    rollout_stats,
    to_tokens,
)
from molt.algo.importance import importance_weights
from molt.algo.kl import KL_ESTIMATORS, adaptive_kl_coef, kl_divergence, register_kl
from molt.algo.losses import POLICY_LOSSES, PolicyLossParams, policy_loss, register_policy_loss, value_loss
from molt.algo.normalize import count_action_tokens, window_normalize
from molt.algo.ops import import_files, masked_mean, masked_whiten
