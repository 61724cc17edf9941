"""Configuration of the trainer side: one flat dataclass whose field names follow the reference flags
(`--actor.*`, `--train.*`, `--fsdp.*`, `--algo.*`), so the CLI config maps onto it field by field.

Design notes and decisions: docs/internals.md, section `molt/trainer/config.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

SCHEDULERS = ("constant", "cosine")
GROUP_ESTIMATORS = ("rloo", "grpo", "dr_grpo")  # they use rewards only, so a KL placed in the reward is lost


@dataclass
class ActorConfig:
    model_name_or_path: str = ""  # --actor.model_name_or_path: HF checkpoint directory or hub name
    # optimizer (--actor.adam.*) and schedule
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    lr_scheduler: str = "constant"  # constant | cosine (cosine decays to min_lr_ratio * lr after warm-up)
    lr_warmup_steps: int = 0
    total_steps: int = 0  # optimizer steps of the run; required by cosine
    min_lr_ratio: float = 0.0
    optim: str = "adam"  # --actor.optim: adam | muon (molt.trainer.optim)
    muon: dict = field(default_factory=dict)  # --actor.muon.*: torch.optim.Muon keywords
    max_norm: float = 1.0  # --actor.max_norm: gradient clipping threshold; <= 0 disables clipping
    # policy loss (--actor.* and --algo.*)
    policy_loss: str = "ppo"  # name in molt.algo's policy-loss registry
    eps_clip_low_high: tuple[float, float] = (0.2, 0.2)  # --actor.eps_clip_low_high
    dual_clip: float | None = None  # PPO dual-clip constant c > 1; None disables
    entropy_coef: float = 0.0  # --actor.entropy_coef
    advantage_estimator: str = "grpo"  # --algo.advantage.estimator (only to warn about ignored KL)
    kl_coef: float = 0.0  # --algo.kl.init_coef; > 0 builds a reference model
    kl_estimator: str = "k3"  # --algo.kl.estimator
    kl_use_loss: bool = True  # --algo.kl.use_loss: KL as a loss term (else as a token reward, done in algo)
    is_correction_level: str = "token"  # --algo.advantage.is_correction_level: off | token | seq | geo
    is_correction_mode: str = "mask"  # --algo.advantage.is_correction_mode: mask | mis | clip | trunc
    is_correction_threshold: tuple[float, float] = (0.5, 2.0)  # --algo.advantage.is_correction_threshold
    ref_model_name_or_path: str = ""  # --ref.model_name_or_path; empty = the actor's checkpoint
    # mixture of experts (molt.trainer.moe)
    routing_replay: bool = False  # --train.routing_replay: route each token to the experts the engine used
    freeze_moe_router: bool = False  # --actor.freeze_moe_router: the routers' weights do not train
    aux_loss_coef: float = 0.0  # --actor.aux_loss_coef: weight of the load-balancing loss
    # micro-batching (--train.*)
    micro_batch_size: int | None = None  # sequences per micro-batch
    max_tokens_per_gpu: int | None = None  # padded tokens per micro-batch (wins over micro_batch_size)
    logprob_chunk_size: int = 512  # action rows per chunk of the vocabulary projection
    share_prefix: bool = True  # --train.share_prefix: run a prefix common to several rows once (single process)
    packing_samples: bool = False  # --fsdp.packing_samples: pack sequences into rows (no padding)
    # model and parallelism (--actor.*, --fsdp.*)
    gradient_checkpoint: bool = False  # --actor.gradient_checkpoint: recompute decoder blocks in backward
    freeze_visual_encoder: bool = False  # --actor.freeze_visual_encoder: no updates to a VLM's vision tower
    param_dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (compute dtype of parameters)
    attn_implementation: str = "sdpa"
    tp_size: int = 1  # --fsdp.tp_size: tensor-parallel degree (DTensor), the rest of the world is FSDP
    offload: bool = False  # --fsdp.offload: parameters, gradients and optimizer state on CPU (CUDA only)
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 42  # --train.seed

    def validate(self) -> ActorConfig:
        """ValueError naming the field on a bad value; returns self."""
        def need(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"{name} {msg} (got {getattr(self, name)!r})")

        need(bool(self.model_name_or_path), "model_name_or_path", "must name a checkpoint")
        need(self.lr >= 0, "lr", "must be >= 0")
        need(self.optim in ("adam", "muon"), "optim", "must be adam or muon")
        need(self.lr_scheduler in SCHEDULERS, "lr_scheduler", f"must be one of {SCHEDULERS}")
        need(self.lr_warmup_steps >= 0, "lr_warmup_steps", "must be >= 0")
        need(self.lr_scheduler != "cosine" or self.total_steps > self.lr_warmup_steps, "total_steps",
             "must exceed lr_warmup_steps for the cosine schedule")
        need(0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", "must be in [0, 1]")
        lo, hi = self.eps_clip_low_high
        need(lo >= 0 and hi >= 0, "eps_clip_low_high", "must be two non-negative numbers")
        need(self.dual_clip is None or self.dual_clip > 1.0, "dual_clip", "must be > 1 or None")
        need(self.kl_coef >= 0, "kl_coef", "must be >= 0")
        need(self.micro_batch_size is None or self.micro_batch_size >= 1, "micro_batch_size", "must be >= 1")
        need(self.max_tokens_per_gpu is None or self.max_tokens_per_gpu >= 1, "max_tokens_per_gpu", "must be >= 1")
        need(self.logprob_chunk_size >= 1, "logprob_chunk_size", "must be >= 1")
        need(self.param_dtype in ("auto", "float32", "bfloat16", "float16"), "param_dtype",
             "must be auto, float32, bfloat16 or float16")
        need(self.tp_size >= 1, "tp_size", "must be >= 1")
        need(self.device in ("auto", "cpu", "cuda"), "device", "must be auto, cpu or cuda")
        return self

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0
