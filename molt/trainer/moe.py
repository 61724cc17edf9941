"""Mixture-of-experts routing in the trainer: rollout routing replay (R3), route agreement, load balancing.

Design notes and decisions: docs/internals.md, section `molt/trainer/moe.py`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FAMILIES = ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "MixtralTopKRouter", "OlmoeTopKRouter")


class Routing:
    """Hooks on every router of `lm` (layer order). `set(mb)` before each forward (CausalLMLogProbs does it)."""

    def __init__(self, lm: nn.Module, cfg):
        """cfg: the run's `molt.config.MoltConfig`."""
        a = cfg.actor
        self.routers = [m for m in lm.modules() if type(m).__name__ in FAMILIES]
        if not self.routers and (cfg.train.routing_replay or a.freeze_moe_router or a.aux_loss_coef):
            raise ValueError(
                "train.routing_replay, actor.freeze_moe_router, actor.aux_loss_coef: the model has no "
                f"MoE router of a supported family ({', '.join(FAMILIES)})"
            )
        self.replay, self.aux = cfg.train.routing_replay, a.aux_loss_coef > 0
        self.record = self.mask = None
        # per layer of the last forward: [N] bool (own top-k set == recorded set); (logits, experts) for the aux loss
        self.match, self.used = [], []
        self.sums = torch.zeros(3)  # over a window: agreeing share, |gap|, tokens (see `observe`)
        for i, router in enumerate(self.routers):
            router.register_forward_hook(functools.partial(self._hook, i))
            router.requires_grad_(not a.freeze_moe_router)

    def set(self, mb) -> None:
        if self.replay and mb.routes is None and not mb.ghost:
            raise ValueError(
                "train.routing_replay: an experience has no routed_experts (vLLM: see docs/moe.md)"
            )
        self.match, self.used, self.mask = [], [], mb.attention_mask
        self.record = None if mb.routes is None else mb.routes.flatten(0, 1)  # [N, layers, k]

    def _hook(self, i: int, router: nn.Module, args, out):
        logits, weights, experts = out
        if self.record is not None:
            rec = self.record[:, i]
            self.match.append((experts.sort(-1).values == rec.sort(-1).values).all(-1))
            if self.replay:
                experts, p = rec, F.softmax(logits.float(), -1).gather(-1, rec)  # the family's normalisation:
                weights = (p / p.sum(-1, keepdim=True) if getattr(router, "norm_topk_prob", True) else p).to(
                    weights.dtype
                )
        if self.aux and torch.is_grad_enabled():
            self.used.append((logits, experts))
        return logits, weights, experts

    def observe(self, model: nn.Module, mb, lp: Tensor) -> None:
        """After the training forward: add agreement and log-prob gap over action tokens to `sums` (with replay: of
        one more forward without it, no gradient)."""
        if self.replay:  # what the trainer's routers would choose on their own
            self.replay = False
            with torch.no_grad():
                lp = model(mb)[0]
            self.replay = True
        if self.record is not None:
            agree = torch.stack(self.match[: len(self.routers)])[:, mb.act_index - 1].float().mean(0).sum()
            gap = (lp.detach() - mb.behavior_logprobs).abs().flatten()[mb.act_index].sum()
            self.sums = self.sums.to(lp.device) + torch.stack([agree, gap, agree.new_tensor(mb.num_actions)])

    def totals(
        self,
    ) -> dict[str, Tensor]:  # the window's sums for `reduce_metrics` (then reset), see `finish`
        sums, self.sums = self.sums, torch.zeros(3)
        return dict(zip(("moe/route_agreement", "moe/logprob_gap", "moe/tokens"), sums))

    @staticmethod
    def finish(out: dict[str, float]) -> None:  # sums -> means over the action tokens with a record (or none)
        n = out.pop("moe/tokens")
        for key in ("moe/route_agreement", "moe/logprob_gap"):
            value = out.pop(key)
            if n > 0:
                out[key] = value / n

    def aux_loss(self) -> Tensor:
        """Switch load-balancing loss of the last forward (a 0-d tensor with gradient to the routers)."""
        total = 0.0
        for logits, experts in self.used[: len(self.routers)]:  # more: recomputed by checkpointing
            e = logits.shape[-1]
            m = torch.ones(len(logits), 1) if self.mask is None else self.mask.reshape(-1, 1).float()
            m = m.to(logits.device) / m.sum()
            f = (F.one_hot(experts, e).sum(1).float() * m).sum(0)
            total = total + e * (f * (F.softmax(logits.float(), -1) * m).sum(0)).sum()
        return total / max(len(self.used), 1)
