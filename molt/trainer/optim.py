"""Optimizers (AdamW, or Muon with AdamW) and learning-rate schedules (constant, cosine with linear warm-up),
shared by actor and critic.

Decisions: schedules are `LambdaLR` multipliers of each optimizer's lr, stepped once per optimizer step (their
state is `last_epoch`). `optim="muon"`: `torch.optim.Muon` takes the 2-D weights inside the decoder blocks
(attention and MLP matrices); embeddings, LM or value head, norms, biases and 3-D expert weights stay with
AdamW. Both follow the schedule; Muon's weight decay None means AdamW's. Muon runs on FSDP2/TP DTensors.
With LoRA (molt.trainer.lora) the only trainable weights are the adapter factors A [r, in] and B [out, r], 2-D
weights of the blocks: Muon takes them all (each factor orthogonalized on its own) and there is no AdamW.
"""

from __future__ import annotations

import math

import torch

from molt.config import OptimConfig


def lr_multiplier(cfg: OptimConfig):
    """step -> factor of the lr: linear warm-up over lr_warmup_steps, then constant or cosine to min_lr_ratio over
    total_steps (both resolved: `molt.config_resolve.resolve`)."""
    warm, total, floor = cfg.lr_warmup_steps, cfg.total_steps, cfg.min_lr_ratio
    if cfg.lr_scheduler == "cosine" and total <= warm:
        raise ValueError(
            f"total_steps ({total}) must exceed lr_warmup_steps ({warm}) for the cosine schedule: "
            "set train.max_steps (or actor.total_steps, critic.total_steps)"
        )

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm  # the first step already trains, at lr / warm
        if cfg.lr_scheduler == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total - warm))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def build_optimizer(params, cfg: OptimConfig, *, tp_size: int = 1, blocks=()):
    """([AdamW, Muon if cfg.optim is muon], [their LambdaLRs]) over the trainable `params`; `blocks`: the decoder
    blocks, whose 2-D weights Muon takes."""
    params = [p for p in params if p.requires_grad]
    # tensor parallelism puts parameters on different device meshes (2-D block weights next to 1-D root
    # weights), which the foreach kernels cannot mix
    foreach = False if tp_size > 1 else None
    hidden = {id(p) for b in blocks for p in b.parameters() if p.ndim == 2} if cfg.optim == "muon" else set()
    adam = [p for p in params if id(p) not in hidden]
    # the fused kernel: on GPUs one launch for all parameters, step counts on the device (no host reads); on a
    # CPU one pass over memory instead of foreach's several (SmolLM2-135M: 0.08 s a step against 0.53 s, 1 thread)
    fused = (
        foreach is None
        and bool(adam)
        and len({p.device.type for p in adam}) == 1
        and adam[0].device.type in ("cuda", "cpu")
        and all(p.dtype in (torch.float32, torch.bfloat16) for p in adam)
    )
    a, m = cfg.adam, cfg.muon
    opts = []
    if adam:  # none with LoRA + Muon: all 2-D
        opts.append(
            torch.optim.AdamW(
                adam,
                lr=a.lr,
                betas=tuple(a.betas),
                eps=a.eps,
                weight_decay=a.weight_decay,
                foreach=foreach,
                fused=fused or None,
            )
        )
    if hidden:
        opts.append(
            torch.optim.Muon(
                [p for p in params if id(p) in hidden],
                lr=m.lr,
                momentum=m.momentum,
                nesterov=m.nesterov,
                ns_steps=m.ns_steps,
                weight_decay=a.weight_decay if m.weight_decay is None else m.weight_decay,
            )
        )
    return opts, [torch.optim.lr_scheduler.LambdaLR(o, lr_multiplier(cfg)) for o in opts]
