"""What actor and critic share: joining the process group, loading and sharding a Hugging Face model, the
per-window micro-batch schedule (with its single all-reduce), and optimizer-step bookkeeping.

Design notes and decisions: docs/internals.md, section `molt/trainer/base.py`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from molt.config import MoltConfig, OptimConfig
from molt.config_resolve import override, resolve
from molt.config_validate import validate
from molt.modeling import ModelSpec
from molt.trainer import parallel
from molt.trainer.batching import MicroBatch, blank_image, collate, ghost_batch, plan_micro_batches
from molt.types import Experience


class ShardedModelTrainer:
    """Holds the device, process group, mesh and configuration (the run's tree: `optim` is the actor's or the
    critic's section); subclasses set `self.model` (an nn.Module whose `forward(input_ids, attention_mask,
    action_mask, temperature, ...)` works on a MicroBatch)."""

    def __init__(self, cfg: MoltConfig, optim: OptimConfig):
        self.cfg, self.optim_cfg, fsdp = cfg, optim, cfg.fsdp
        # the policy's LoRA adapters by role (multiagent.adapters): a micro-batch holds one role's experiences
        self.adapters = cfg.multiagent.adapter_names() if optim is cfg.actor and optim.lora_rank else []
        self.device = parallel.resolve_device(fsdp.device)
        if fsdp.offload and self.device.type != "cuda":
            raise ValueError(
                "fsdp.offload: optimizer-state CPU offload is a CUDA option (the CPU path has nothing "
                "to offload)"
            )
        auto = "bfloat16" if self.device.type == "cuda" else "float32"
        self.param_dtype = getattr(torch, auto if cfg.actor.dtype == "auto" else cfg.actor.dtype)
        one_rank_mesh = self.device.type == "cuda" or self.param_dtype != torch.float32 or fsdp.offload
        self.rank, self.world = parallel.init_distributed(self.device, one_rank=one_rank_mesh)
        self.mesh = parallel.build_mesh(self.device, self.world, fsdp.tp_size, one_rank=one_rank_mesh)
        if fsdp.tp_size > 1 and self.mesh is None:
            raise ValueError("fsdp.tp_size > 1 needs a process group with at least tp_size ranks")
        torch.manual_seed(cfg.train.seed)
        # see docs/internals.md (molt/trainer/base.py): packed, a layout (any ranks, checkpointing too); padded, a
        # KV cache and a second decoder call (a single plain process only); a CPU win either way
        if fsdp.packing_samples:
            self.share_prefix = cfg.train.share_prefix and self.device.type == "cpu"
        else:
            self.share_prefix = (
                cfg.train.share_prefix and self.mesh is None and not cfg.actor.gradient_checkpoint
            )
        self.step = 0  # optimizer steps taken
        # optimizer steps skipped (non-finite): in all, and the last run
        self.skipped = self.skipped_in_a_row = 0
        self.window_tokens = 0.0  # action tokens of the last scheduled window (all ranks), on the host
        self.pad_id = 0
        self.blank = None  # see `molt.trainer.batching.blank_image`
        # a frozen model the window runs besides `model` (the actor's reference)
        self.ref: nn.Module | None = None

    @classmethod
    def from_pretrained(cls, model_name_or_path: str, **overrides: Any):
        """`molt train`'s defaults with `model_name_or_path` (the actor's; the critic's too unless overridden);
        `overrides`: dotted fields as the command line names them, `**{"actor.adam.lr": 1e-5, "fsdp.device": "cpu"}`."""
        cfg = override(MoltConfig(), {"actor.model_name_or_path": str(model_name_or_path), **overrides})
        return cls(resolve(validate(cfg, check_files=False)))

    # ---- models ----------------------------------------------------------------------------------------
    def load_lm(self, path: str, auto_class=None) -> nn.Module:
        """`from_pretrained` in fp32 on CPU (the master weights; compute dtype comes from mixed precision);
        `--actor.freeze_visual_encoder` freezes a vision-language model's vision tower."""
        attn, spec = self.cfg.fsdp.attn_implementation, ModelSpec.from_pretrained(path)
        if self.cfg.fsdp.packing_samples or attn == "sdpa" and not spec.sliding:  # see molt.trainer.packing
            from molt.trainer.packing import register

            attn = register()
        if spec.vision and self.world > 1:  # FSDP2 collectives of the vision tower (molt.trainer.batching)
            self.blank = blank_image(path, self.device)
        lm = (auto_class or spec.auto_class).from_pretrained(
            path, dtype=torch.float32, attn_implementation=attn
        )
        lm.config.use_cache = False
        freeze = self.cfg.actor.freeze_visual_encoder
        frozen = [
            p.requires_grad_(False)
            for n, p in lm.named_parameters()
            if freeze and re.search(r"\.(vision_tower|visual|vision_model)\.", n)
        ]  # LLaVA, Qwen2-VL, Idefics3
        if freeze and not frozen:
            raise ValueError(f"actor.freeze_visual_encoder: {path} has no vision encoder")
        self.pad_id = spec.pad_token_id  # the engine's too
        return lm

    def wrap(self, module: nn.Module, lm: nn.Module, *, trainable: bool) -> nn.Module:
        """LoRA adapters on `lm` when this trainer's section asks (molt.trainer.lora), tensor-parallel split
        (tp_size > 1), then FSDP2 over "dp"; a single process only moves to device."""
        if trainable and self.optim_cfg.lora_rank:
            from molt.trainer.lora import apply_lora

            apply_lora(lm, self.optim_cfg, self.adapters)
        if not trainable:
            module.requires_grad_(False).eval()
        elif self.cfg.actor.gradient_checkpoint:
            # non-reentrant: works under FSDP2's hooks and with inputs that do not require grad
            # (transformers renamed the method in 5.x; the old name remains as a deprecated alias)
            enable = getattr(lm, "activation_checkpointing_enable", None) or lm.gradient_checkpointing_enable
            enable({"use_reentrant": False})
        if self.mesh is None:
            return module.to(self.device)
        if self.cfg.fsdp.tp_size > 1:
            parallel.apply_tensor_parallel(lm, self.mesh["tp"])
        parallel.shard(
            module,
            parallel.decoder_layers(lm),
            self.mesh,
            param_dtype=self.param_dtype,
            offload=self.cfg.fsdp.offload and trainable,
            keep_unsharded=self.world == 1,
        )
        return module

    def end_pass(self, module: nn.Module) -> None:
        """After the last micro-batch of a step or pass: on a one-rank mesh, free the unsharded (cast) weights,
        which must not outlive an optimizer step (they would be stale) or meet a state dict."""
        if self.mesh is not None and self.world == 1:
            parallel.reshard(module)

    # ---- one window's schedule ---------------------------------------------------------------------------
    def schedule(self, experiences: list[Experience]) -> tuple[list[list[int]], int, torch.Tensor]:
        """(micro-batch plan, number of passes every rank runs, global action-token count) via ONE all-reduce."""
        for e in experiences:
            if e.token_ids is None:
                raise ValueError(
                    f"experience {e.rollout_id}/{e.segment_index} is offloaded: reload() it first"
                )
        parts = [list(range(len(experiences)))]
        if self.adapters:  # one role a micro-batch: it runs through that role's adapter (`micro_batches`)
            roles = sorted({e.role for e in experiences})
            parts = [[i for i, e in enumerate(experiences) if e.role == role] for role in roles]
        plan = [
            [part[j] for j in mb]
            for part in parts
            for mb in plan_micro_batches(
                [len(experiences[i].token_ids) for i in part],
                self.cfg.train.micro_batch_size or None,
                self.cfg.train.max_tokens_per_gpu or None,
                packed=self.cfg.fsdp.packing_samples,
            )
        ]
        count = sum(int(np.count_nonzero(e.action_mask)) for e in experiences)
        if self.world == 1:  # nothing to agree on: count on the host, one copy to the device
            if not plan:
                raise ValueError("experiences: the window is empty on every rank")
            self.window_tokens = float(count)
            return plan, len(plan), torch.tensor(count, dtype=torch.int64).to(self.device, non_blocking=True)
        dp = parallel.dp_size(self.mesh)
        stats = torch.zeros(1 + dp, dtype=torch.float64)
        stats[0] = float(count)
        stats[1 + (self.mesh["dp"].get_local_rank() if self.mesh is not None else 0)] = len(plan)
        # gloo reduces CPU tensors, NCCL device tensors: the compute device fits both
        stats = parallel.all_reduce_sum(stats.to(self.device), self.mesh)
        # the one read-back of the step's start: the window's count, every schedule's length
        host = stats.tolist()
        n_passes, self.window_tokens = int(max(host[1:])), host[0]
        if n_passes == 0:
            raise ValueError("experiences: the window is empty on every rank")
        return plan, n_passes, stats[0].to(torch.int64)

    def micro_batches(
        self,
        experiences: list[Experience],
        plan: list[list[int]],
        n_passes: int,
        *,
        extra: dict[str, list | None] | None = None,
        need_advantages: bool = True,
    ) -> Iterator[tuple[list[int], MicroBatch]]:
        """Collate the planned micro-batches one at a time, then ghosts until `n_passes`. `extra`: named
        per-token arrays (or lists) aligned with `experiences` (None values are dropped)."""
        extra = {k: v for k, v in (extra or {}).items() if v is not None}
        for k, v in extra.items():
            if len(v) != len(experiences):
                raise ValueError(f"{k}: {len(v)} rows for {len(experiences)} experiences")
        pack = self.cfg.fsdp.packing_samples
        for k in range(n_passes):
            idx = plan[k] if k < len(plan) else []
            mb = (
                collate(
                    [experiences[i] for i in idx],
                    self.pad_id,
                    self.device,
                    extra={n: [v[i] for i in idx] for n, v in extra.items()},
                    need_advantages=need_advantages,
                    share_prefix=self.share_prefix,
                    pack=pack,
                )
                if idx
                else ghost_batch(self.pad_id, self.device, extra, pack=pack)
            )
            mb.blank = None if mb.images else self.blank
            if self.adapters:  # a role without an adapter (not trained: a dump's) runs the base
                from molt.trainer.lora import use_adapter

                role = experiences[idx[0]].role if idx else ""
                use_adapter(self.lm, role if role in self.adapters else None)  # only the actor has adapters
            yield idx, mb

    @torch.no_grad()
    def per_token_pass(self, model: nn.Module, experiences: list[Experience], forward) -> list[np.ndarray]:
        """`forward(mb) -> [R, L]` over every micro-batch of `experiences` in eval mode, as one float32 array per
        experience (0.0 over a shared prefix, which holds no actions). Collective; read back after the last
        pass was queued."""
        model.eval()
        plan, n_passes, _ = self.schedule(experiences)
        passes = [
            (idx, mb.spans, forward(mb))
            for idx, mb in self.micro_batches(experiences, plan, n_passes, need_advantages=False)
        ]
        self.end_pass(model)
        out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(experiences)
        for idx, spans, x in passes:
            x = x.float().cpu().numpy()
            for i, (row, start, n, skip) in zip(idx, spans):
                out[i] = np.concatenate([np.zeros(skip, np.float32), x[row, start : start + n - skip]])
        return out

    def accumulate(self, sums: dict[str, torch.Tensor], metrics: dict, weight: float) -> None:
        """sums[k] += metrics[k] * weight, on the device (no read-back per micro-batch)."""
        for k, v in metrics.items():
            v = torch.as_tensor(v, device=self.device).detach().to(torch.float64) * weight
            sums[k] = sums[k] + v if k in sums else v

    def reduce_metrics(
        self, sums: dict[str, torch.Tensor], weight: float, totals: dict[str, torch.Tensor]
    ) -> dict[str, float]:
        """One all-reduce and one read-back for all window metrics: `sums[k]` (metric * tokens summed over
        micro-batches) become token-weighted means over all ranks; `totals[k]` become plain sums over ranks."""
        keys = sorted(sums) + sorted(totals)
        vals = [sums[k] for k in sorted(sums)] + [totals[k] for k in sorted(totals)]
        vec = torch.stack(
            [torch.as_tensor(v, device=self.device).to(torch.float64).reshape(()) for v in vals]
            + [torch.tensor(float(weight), dtype=torch.float64, device=self.device)]
        )
        vec = parallel.all_reduce_sum(vec.to(self.device), self.mesh).tolist()
        denom = max(vec[-1], 1.0)
        return {k: v / denom if k in sums else v for k, v in zip(keys, vec[:-1])}

    def train_window(
        self,
        experiences: list[Experience],
        loss_of,
        loss_key: str,
        *,
        extra: dict | None = None,
        need_advantages: bool = True,
        totals=dict,
    ) -> tuple[dict[str, float], dict[str, float]]:
        """One optimizer step on this rank's share of a window (collective). `loss_of(mb, global_count, dp)`: a
        micro-batch's window-normalized loss and metrics (a ghost's loss is zeroed here); `totals()`: more sums to
        reduce after the last micro-batch. Returns (the window's metrics, `loss_key` its loss; `optimizer_step`'s)."""
        self.model.train()
        plan, n_passes, global_count = self.schedule(experiences)
        dp = parallel.dp_size(self.mesh)
        sums: dict[str, torch.Tensor] = {}
        tokens, window_loss = 0, torch.zeros((), device=self.device)
        for _, mb in self.micro_batches(
            experiences, plan, n_passes, extra=extra, need_advantages=need_advantages
        ):
            loss, metrics = loss_of(mb, global_count, dp)
            if mb.ghost:
                loss = loss * 0.0
            loss.backward()
            window_loss += loss.detach() / dp  # this rank's share of the window loss
            tokens += mb.num_actions
            self.accumulate(sums, metrics, mb.num_actions)
        self.end_pass(self.model)
        if self.ref not in (None, self.model):
            self.end_pass(self.ref)
        out = self.reduce_metrics(sums, tokens, {loss_key: window_loss, **totals()})
        return out, self.optimizer_step(out[loss_key])

    # ---- optimizer step ----------------------------------------------------------------------------------
    def optimizer_step(self, loss: float) -> dict[str, float]:
        """Clip (DTensor-aware), step the optimizer and the schedule; returns grad norm, the lr used and
        "train/skipped_steps". `loss`: the window's loss as every rank read it after the all-reduce of the
        metrics; with the gradient norm (a global reduction too) it makes every rank take the same decision: a
        non-finite one skips the step, dropping the gradients and changing no state (docs/internals.md)."""
        lr = self.schedulers[0].get_last_lr()[0]  # AdamW's, or Muon's where all is Muon (LoRA)
        params = [p for o in self.optimizers for g in o.param_groups for p in g["params"]]
        max_norm = self.optim_cfg.max_norm
        norm = parallel.clip_grad_norm(params, max_norm)
        skip = not (math.isfinite(loss) and math.isfinite(norm))
        for opt, schedule in zip(self.optimizers, self.schedulers):
            if not skip:
                opt.step()
                schedule.step()
            opt.zero_grad(set_to_none=True)
        self.step += not skip
        self.skipped += skip
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skip else 0
        return {
            "grad_norm": norm,
            "lr": lr,
            "clip_coef": min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0,
            "train/skipped_steps": float(skip),
        }

    # ---- checkpoints -------------------------------------------------------------------------------------
    def save(self, path: str) -> None:
        """DCP checkpoint of model, optimizer, schedule, step and RNG state (every rank calls it)."""
        from molt.trainer.checkpoint import save_checkpoint

        save_checkpoint(path, self)

    def load(self, path: str) -> None:
        """Resume from `save(path)` (every rank calls it, after constructing with the same config)."""
        from molt.trainer.checkpoint import load_checkpoint

        load_checkpoint(path, self)
