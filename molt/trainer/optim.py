"""AdamW and learning-rate schedules (constant, cosine with linear warm-up), shared by actor and critic.

Decision: schedules are `LambdaLR` multipliers of the configured lr, stepped once per optimizer step, so their
whole state is `last_epoch` and checkpoints/resumes through `scheduler.state_dict()`.
"""
from __future__ import annotations

import math

import torch

from molt.trainer.config import ActorConfig


def lr_multiplier(cfg: ActorConfig):
    """step -> factor of cfg.lr: linear warm-up over lr_warmup_steps, then constant or cosine to min_lr_ratio."""
    warm, total, floor = cfg.lr_warmup_steps, cfg.total_steps, cfg.min_lr_ratio

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm  # the first step already trains, at lr / warm
        if cfg.lr_scheduler == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total - warm))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def build_optimizer(params, cfg: ActorConfig, *, foreach: bool | None = None):
    """(AdamW, LambdaLR) over the trainable `params`. `foreach=False` is needed when parameters live on
    different device meshes (tensor parallelism: 2-D block weights next to 1-D root weights)."""
    params = [p for p in params if p.requires_grad]
    # on GPUs the fused kernel: one launch for all parameters, step counts on the device (no host reads)
    fused = foreach is None and bool(params) and all(p.is_cuda for p in params)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.adam_eps,
                            weight_decay=cfg.weight_decay, foreach=foreach, fused=fused or None)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_multiplier(cfg))
