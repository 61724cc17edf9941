"""The policy trainer: one `train_step(experiences)` per optimizer window, log-prob passes for the runtime, and
the weights out (refit stream, Hugging Face export).

Design notes and decisions: docs/internals.md, section `molt/trainer/actor.py`.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from contextlib import nullcontext

import torch

from molt.algo import (
    PolicyLossParams,
    importance_weights,
    kl_divergence,
    policy_loss,
    window_normalize,
)
from molt.config import MoltConfig
from molt.trainer import parallel
from molt.trainer.base import ShardedModelTrainer
from molt.trainer.logprobs import CausalLMLogProbs
from molt.trainer.moe import Routing
from molt.trainer.optim import build_optimizer
from molt.types import Experience

ALIASES = {"policy/clip_frac": "policy_clip_ratio", "is/logprob_gap": "logprobs_diff"}


class Actor(ShardedModelTrainer):
    """Build on every rank with the same configuration: `Actor(cfg)` reads the actor, algo, fsdp and trainer (train)
    sections of a validated and resolved `molt.config.MoltConfig`; or `Actor.from_pretrained(path, **overrides)`
    (`ShardedModelTrainer.from_pretrained`).
    Under torchrun it joins the process group from the environment."""

    def __init__(self, cfg: MoltConfig):
        super().__init__(cfg, cfg.actor)
        a, kl = cfg.actor, cfg.algo.kl
        self.lm = self.load_lm(a.model_name_or_path)
        self.routing = Routing(self.lm, cfg)
        self.routing = self.routing if self.routing.routers else None  # a dense model
        # before FSDP2 renames their classes
        blocks = parallel.decoder_layers(self.lm) if a.optim == "muon" else ()
        self.model = self.wrap(
            CausalLMLogProbs(self.lm, a.logprob_chunk_size, self.routing), self.lm, trainable=True
        )
        self.optimizers, self.schedulers = build_optimizer(
            self.model.parameters(), a, tp_size=cfg.fsdp.tp_size, blocks=blocks
        )
        self.loss_params = PolicyLossParams(
            eps_low=a.eps_clip_low_high[0],
            eps_high=a.eps_clip_low_high[1],
            dual_clip=a.dual_clip,
            entropy_coef=a.entropy_coef,
            kl_coef=kl.init_coef if kl.use_loss else 0.0,
        ).validate()
        # test-only fault injection (tests/*/test_nonfinite.py): these optimizer windows of this process, counted
        # from 1 with skipped ones, get a NaN added to their loss on this rank (the gradients stay finite)
        self.nan_windows = {int(w) for w in os.environ.get("MOLT_FAULT_NAN_LOSS", "").split(",") if w}
        if kl.init_coef > 0 and a.lora_rank and cfg.ref.model_name_or_path in (None, a.model_name_or_path):
            self.ref = self.model  # the base model is this one with the adapters off (`_reference`): no copy
        elif kl.init_coef > 0:
            # a reference model: the KL's, in the loss or (the runtime's) in the token rewards
            ref_lm = self.load_lm(cfg.ref.model_name_or_path or a.model_name_or_path)
            self.ref = self.wrap(CausalLMLogProbs(ref_lm, a.logprob_chunk_size), ref_lm, trainable=False)

    # ---- training ----------------------------------------------------------------------------------------
    def train_step(self, experiences: list[Experience], old_logprobs: list | None = None) -> dict[str, float]:
        """One optimizer step on this rank's share of the window (every rank calls it, possibly with a different
        number of experiences, possibly none). Experiences need `advantages`. Returns window metrics."""
        t0 = time.perf_counter()
        routing = self.routing
        out, step_metrics = self.train_window(
            experiences,
            self._loss,
            "policy_loss",
            extra={"old_logprobs": old_logprobs},
            totals=routing.totals if routing is not None else dict,
        )
        if routing is not None:
            routing.finish(out)
        out.update({dst: out[src] for src, dst in ALIASES.items() if src in out})
        if "is/retained_frac" in out:
            out["is_filter_ratio"] = 1.0 - out["is/retained_frac"]
        elapsed = time.perf_counter() - t0
        local_tokens = float(sum(len(e.token_ids) for e in experiences))
        out.update(
            {
                "actor_grad_norm": step_metrics["grad_norm"],
                "actor_lr": step_metrics["lr"],
                "actor_grad_clip_coef": step_metrics["clip_coef"],
                "actor_tokens_per_s": local_tokens / elapsed,
                "actor_window_tokens": self.window_tokens,
                "timing/policy_train": elapsed,
                "train/skipped_steps": step_metrics["train/skipped_steps"],
            }
        )
        return out

    def _loss(self, mb, global_count: torch.Tensor, dp: int) -> tuple[torch.Tensor, dict]:
        """A micro-batch's share of the window's policy loss (`train_window`)."""
        adv, coef = self.cfg.algo.advantage, self.cfg.actor.aux_loss_coef
        lp, ent = self.model(mb, True)
        if self.routing is not None:
            aux = self.routing.aux_loss()  # before `observe`'s own forward
            self.routing.observe(self.model, mb, lp)
        old = mb.extra.get("old_logprobs", lp.detach())
        mask = mb.action_mask
        weights, metrics = importance_weights(
            old,
            mb.behavior_logprobs,
            mask,
            adv.is_correction_level,
            adv.is_correction_mode,
            *adv.is_correction_threshold,
            seq_ids=mb.seq_ids,
        )
        kl = None
        if self.ref is not None and self.cfg.algo.kl.use_loss:
            with torch.no_grad(), self._reference():
                ref_lp, _ = self.ref(mb)
            kl, kl_metrics = kl_divergence(lp, ref_lp, mask, self.cfg.algo.kl.estimator, placement="loss")
            metrics.update(kl_metrics)
        tok_loss, pl_metrics = policy_loss(
            self.cfg.actor.policy_loss,
            lp,
            old,
            mb.advantages,
            mask,
            params=self.loss_params,
            is_weights=weights,
            entropy=ent,
            kl=kl,
            seq_ids=mb.seq_ids,
        )
        loss, _ = window_normalize(tok_loss, mask, global_count, dp_size=dp)
        if coef > 0:  # token-weighted over the window's micro-batches, as the policy loss
            loss = loss + coef * aux * mb.num_actions * dp / global_count.clamp(min=1)
            metrics["moe/aux_loss"] = aux
        if self.step + self.skipped + 1 in self.nan_windows:
            loss = loss + math.nan
        return loss, {**metrics, **pl_metrics}

    # ---- log-prob passes ---------------------------------------------------------------------------------
    @torch.no_grad()
    def compute_logprobs(self, experiences: list[Experience], reference: bool = False) -> list:
        """Per-token log-probs of each experience's action tokens (a float32 array each, 0.0 elsewhere) under the
        policy, or under the reference model. Collective: every rank calls it with its own experiences."""
        model = self.ref if reference else self.model
        if model is None:
            raise ValueError("reference: no reference model (algo.kl.init_coef is 0)")
        with self._reference() if reference else nullcontext():
            return self.per_token_pass(model, experiences, lambda mb: model(mb)[0])

    def _reference(self):
        """Where the reference is the policy's own module: its adapters off inside."""
        from molt.trainer.lora import adapters_off

        return adapters_off(self.lm) if self.ref is self.model else nullcontext()

    # ---- weights out -------------------------------------------------------------------------------------
    def iter_weights(
        self,
        bucket_bytes: int = 256 << 20,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full parameters in Hugging Face names, bucket by bucket (collective: all ranks iterate); with LoRA only
        what a refit changes: the adapter factors for the embedded engine, which holds the same adapters, and the
        targeted modules' merged weights for vLLM. See `molt.trainer.weights.iter_weight_buckets` (tied
        embeddings appear once, as the input embedding)."""
        from molt.trainer.weights import iter_weight_buckets

        return iter_weight_buckets(self.lm, bucket_bytes, dtype=dtype, device=device, refit=self._refit)

    @property
    def _refit(self) -> str:
        return "adapters" if self.cfg.rollout.engine == "hf" or self.adapters else "merged"

    def weight_plan(
        self, bucket_bytes: int = 256 << 20, dtype: torch.dtype | None = None
    ) -> list[list[tuple]]:
        """The buckets of `iter_weights` as (HF name, shape, dtype name), for receivers of a collective refit."""
        from molt.trainer.weights import plan_weight_buckets

        return plan_weight_buckets(self.lm, bucket_bytes, dtype=dtype, refit=self._refit)

    def export_hf(self, path: str, dtype: torch.dtype | None = None, bucket_bytes: int = 1 << 30) -> None:
        """Write a Hugging Face checkpoint (safetensors shards + config + tokenizer) that `from_pretrained` and
        vLLM load; with LoRA the merged model, and the adapter in PEFT's format in `path/adapter`; with an
        adapter per role, both for each role in `path/<role>`. Collective; rank 0 writes."""
        from molt.trainer.lora import ADAPTER, export_adapter, lora_layers
        from molt.trainer.weights import export_hf

        base, write = self.cfg.actor.model_name_or_path, self.rank == 0
        for adapter in self.adapters or [ADAPTER]:
            out = os.path.join(path, adapter) if self.adapters else path
            kw = {"dtype": dtype, "bucket_bytes": bucket_bytes, "write": write, "adapter": adapter}
            export_hf(self.lm, out, tokenizer_from=base, **kw)
            if lora_layers(self.lm):
                export_adapter(self.lm, os.path.join(out, "adapter"), base, write=write, adapter=adapter)
