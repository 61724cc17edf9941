"""The configuration tree of a Molt run, the one set of defaults: records only, importing nothing of molt. The
functions over the tree live in their own modules: `validate` (molt.config_validate: errors, nothing changed),
`resolve`, `override`, `from_dict`/`to_dict` (molt.config_resolve); `load_config` (the command line: molt.cli).

Design notes and decisions: docs/internals.md, section `molt/config.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class AdamConfig:
    lr: float = 1e-6
    """AdamW learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    eps: float = 1e-8
    """AdamW epsilon."""


@dataclass
class MuonConfig:
    lr: float = 0.02
    """Muon learning rate (the 2-D weights of the decoder blocks; the rest keeps AdamW)."""
    momentum: float = 0.95
    """Muon momentum."""
    weight_decay: float | None = None
    """Muon decoupled weight decay (None: adam.weight_decay)."""
    ns_steps: int = 5
    """Newton-Schulz iterations of the orthogonalization."""
    nesterov: bool = True
    """Nesterov momentum."""


@dataclass
class OptimConfig:
    """An optimizer and its learning-rate schedule: the actor's and the critic's."""

    adam: AdamConfig = field(default_factory=AdamConfig)
    optim: Literal["adam", "muon"] = "adam"
    """Optimizer: AdamW, or torch.optim.Muon for the decoder blocks' 2-D weights and AdamW for the rest."""
    muon: MuonConfig = field(default_factory=MuonConfig)
    max_norm: float = 1.0
    """Gradient clipping norm (0 disables)."""
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    """Learning-rate schedule."""
    lr_warmup_steps: int = 0
    """Linear warm-up steps."""
    lr_warmup_ratio: float = 0.0
    """Warm-up as a share of all optimizer steps (the larger of this and lr_warmup_steps applies)."""
    min_lr_ratio: float = 0.0
    """Floor of the cosine schedule, as a share of the learning rate."""
    total_steps: int = 0
    """Optimizer steps of the run, the cosine schedule's length (0: derived from train.max_steps)."""
    lora_rank: int = 0
    """LoRA rank: train PEFT adapters on a frozen base (0: full fine-tuning; docs/lora.md)."""
    lora_alpha: int = 16
    """LoRA scaling numerator (the adapters' update is alpha / rank * B @ A)."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input."""
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Module names that get adapters (default: the attention and MLP projections)."""

    def lora_options(self) -> dict[str, Any]:
        """PEFT `LoraConfig` arguments: the trainer's adapters and the embedded engine's copy of them."""
        return {
            "r": self.lora_rank,
            "lora_alpha": self.lora_alpha,
            "lora_dropout": self.lora_dropout,
            "target_modules": list(self.lora_target_modules),
        }


@dataclass
class ActorConfig(OptimConfig):
    model_name_or_path: str = "smollm2-135m-instruct"
    """Policy model: a local HF checkpoint directory, a built-in alias, or a hub id."""
    eps_clip_low_high: tuple[float, float] = (0.2, 0.28)
    """PPO clip range (low, high) of the ratio around 1."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 for negative advantages (None disables)."""
    policy_loss: str = "ppo"
    """Policy loss by registered name (ppo, gspo, cispo, ...)."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    gradient_checkpoint: bool = False
    """Activation checkpointing of decoder blocks."""
    freeze_visual_encoder: bool = False
    """Keep a vision-language model's vision tower fixed (its projector and decoder still learn)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype of the trainer's parameters (fp32 master weights; auto: bfloat16 on a GPU, float32 on a CPU)."""
    freezing_steps: int = 0
    """Training steps at the start in which the actor does not learn (only the critic, for gae)."""
    freeze_moe_router: bool = False
    """MoE: the routers' weights do not train."""
    aux_loss_coef: float = 0.0
    """MoE: weight of the load-balancing (Switch) loss."""
    logprob_chunk_size: int = 512
    """Action rows per chunk of the trainer's vocabulary projection (bounds the logits' memory)."""


@dataclass
class ModelRefConfig:
    model_name_or_path: str | None = None
    """Model for this role (None: the actor's model)."""


@dataclass
class CriticConfig(OptimConfig):
    """The value model of `gae`, with an optimizer of its own (reference defaults)."""

    model_name_or_path: str | None = None
    """Critic model (None: the actor's model)."""
    adam: AdamConfig = field(default_factory=lambda: AdamConfig(lr=5e-6))
    value_clip: float = 0.2
    """Clip range of the value loss around the old values (0 disables)."""
    max_epochs: int = 0
    """Critic passes over each training step's rollouts (0: train.max_epochs)."""


@dataclass
class TrainConfig:
    agent_path: str = ""
    """Agent file (.py exporting AgentRunner)."""
    batch_size: int = 0
    """Rollouts per optimizer step (0: every rollout of a training step in one optimizer step)."""
    micro_batch_size: int = 0
    """Sequences per micro-batch (0: split by max_tokens_per_gpu)."""
    max_tokens_per_gpu: int = 4096
    """Token budget of a micro-batch (0: micro-batches of train.micro_batch_size, or the whole window)."""
    share_prefix: bool = True
    """Run context tokens that several rows of a micro-batch share (a prompt group) once (one trainer process)."""
    async_queue_size: int = 2
    """Completed groups buffered ahead of the trainer, in training steps."""
    max_staleness: int = 1
    """Max policy versions between the oldest token of a trained sample and the trainer (0: synchronous)."""
    partial_rollout_enable: bool = False
    """Keep requests alive across weight refits (requires importance correction)."""
    weight_sync: Literal["auto", "object_store", "collective"] = "auto"
    """How refit moves weights: through the Ray object store, or broadcast by trainer rank 0 over a dedicated
    group (NCCL on GPU, gloo on CPU). auto: collective with vLLM engines, the object store otherwise."""
    max_steps: int = 0
    """Training steps to run (0: num_episodes passes over the prompts, rollout.batch_size prompts a step)."""
    num_episodes: int = 1
    """Passes over the prompt dataset when max_steps is 0."""
    max_epochs: int = 1
    """Optimizer passes over each training step's rollouts, batch_size rollouts an optimizer step (PPO epochs)."""
    seed: int = 42
    """Global seed (data order, sampling seeds, init)."""
    num_ranks: int = 1
    """Trainer data-parallel ranks (FSDP2)."""
    dump_trajectories_steps: int = 0
    """Write a readable trajectory dump every N steps (0: never)."""
    routing_replay: bool = False
    """MoE: route every token through the experts the engine chose for it (R3; docs/moe.md)."""
    max_skipped_steps: int = 3
    """Consecutive optimizer steps skipped for a non-finite loss or gradient norm that stop the run (checkpointed)."""
    stall_timeout_s: float = 3600.0
    """Stop the run (with a checkpoint) when one step's wait for rollouts lasts this long (0: never)."""


@dataclass
class RolloutConfig:
    batch_size: int = 2
    """Prompts per training step."""
    n_samples_per_prompt: int = 8
    """Rollouts per prompt (group size)."""
    max_new_tokens: int = 48
    """Max new tokens per model call."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Top-k sampling (-1 disables)."""
    engine: Literal["hf", "vllm"] = "hf"
    """Inference engine: embedded transformers (CPU/one GPU) or vLLM (GPU)."""
    engine_process: bool = True
    """Run the embedded (hf) engine in a process of its own, apart from the capture server and the agents."""
    prefix_cache_mb: int = 1024
    """Embedded engine's prefix cache in MB, shared by every request (blocks of 16 tokens, least recently used out
    first): a prompt prefills only what no earlier request computed; exact (0: off)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "float32"
    """Embedded engine's dtype, apart from the trainer's (auto: bfloat16 on a GPU and on a CPU that computes bf16
    natively, else float32; vLLM takes vllm.dtype)."""
    cuda_graphs: bool = True
    """Embedded engine on a GPU: decode steps replay CUDA graphs (text models without expert routers)."""
    num_workers: int = 1
    """Rollout workers (each: an engine, a capture server, agent runners)."""
    tool_parser: str = "auto"
    """Tool-call format of replies: auto (the model's own parser, else its template's), hermes, qwen3_coder, llama3_json,
    mistral, mistral_v11 or none."""
    timeout_s: float = 300.0
    """Time limit of one rollout."""
    max_turns: int = 8
    """Turn limit of an Env episode."""
    max_failed_retries: int = 2
    """Re-runs of failed rollouts within a group before the group is dropped."""
    failure_window: int = 64
    """Stop the run (with a checkpoint) when max_failed_share of the last this many rollouts failed (0: never)."""
    max_failed_share: float = 1.0
    """Share of the last failure_window rollouts that stops the run when they failed (1.0: all of them)."""
    engine_max_restarts: int = 3
    """Deaths of a worker's engine process within 10 minutes that it survives (by a restart); one more stops the run."""
    worker_max_restarts: int = 3
    """Deaths of rollout worker actors within 10 minutes that the run survives (by new actors); one more stops it."""


@dataclass
class AdvantageConfig:
    estimator: str = "grpo"
    """Advantage estimator by registered name (reinforce, reinforce_baseline, rloo, grpo, dr_grpo, gae,
    on_policy_distill)."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 1.0
    """GAE lambda."""
    is_correction_level: Literal["off", "token", "seq", "geo"] = "token"
    """Importance correction level for the behavior/trainer mismatch."""
    is_correction_mode: Literal["mask", "mis", "clip", "trunc"] = "mask"
    """Outside the band: mask (weight 0; survivors keep their token ratio), mis (weight 0; survivors take the
    level's ratio), clip the weight, or truncate it from above (docs/algo.md)."""
    is_correction_threshold: tuple[float, float] = (0.0, 2.0)
    """Importance-ratio band (low, high)."""
    no_whiten: bool = False
    """Do not whiten the advantages of reinforce, reinforce_baseline and gae over the batch."""
    reward_coef: float = 0.0
    """on_policy_distill: weight of the group-centred reward next to the teacher's KL (0: reward ignored)."""


@dataclass
class KLConfig:
    init_coef: float = 0.0
    """KL coefficient against the reference model (0: no reference model)."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator."""
    use_loss: bool = True
    """KL as a loss term (True) or as a token reward (False)."""
    target: float | None = None
    """Adaptive KL: the KL the coefficient steers toward (None: a fixed init_coef)."""
    horizon: int = 10000
    """Adaptive KL: rollouts over which the coefficient adapts."""


@dataclass
class AlgoConfig:
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    dynamic_filtering_enable: bool = False
    """Drop degenerate groups (DAPO) and backfill."""
    dynamic_filtering_range: tuple[float, float] = (0.0, 1.0)
    """Keep groups whose mean score lies in this closed band (all-equal groups are always dropped)."""
    plugins: list[str] = field(default_factory=list)
    """Python files that register estimators, policy losses or KL estimators (docs/algo.md), imported by the
    controller and every trainer rank."""


@dataclass
class VLLMConfig:
    num_engines: int = 1
    """vLLM engines."""
    tensor_parallel_size: int = 1
    """Tensor parallel size of each engine."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory for each engine."""
    engine_args: dict[str, str] = field(default_factory=dict)
    """Further vllm.AsyncEngineArgs keywords: NAME VALUE pairs, values read as YAML (8192, true, {...})."""


@dataclass
class FSDPConfig:
    tp_size: int = 1
    """Tensor-parallel size (DTensor)."""
    ep_size: int = 1
    """Expert-parallel size (GPU path)."""
    cp_size: int = 1
    """Context-parallel size (GPU path)."""
    offload: bool = False
    """Optimizer state CPU offload (GPU path)."""
    attn_implementation: str = "sdpa"
    """Attention kernel of the trainer's model (transformers' attn_implementation: sdpa, flash_attention_2, eager)."""
    packing_samples: bool = False
    """Pack sequences into micro-batch rows up to the token budget, without padding (varlen attention)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Trainer device (auto: cuda when there is a GPU)."""


@dataclass
class DataConfig:
    prompt_dataset: str = ""
    """Training prompts: a JSONL or parquet/json/arrow/csv file, a dataset directory or a hub name; several,
    comma-separated, are mixed (molt.runtime.data)."""
    prompt_probs: str = ""
    """Mixing probabilities of the prompt_dataset entries, comma-separated (empty: equal)."""
    prompt_split: str = "train"
    """Split of the prompt datasets."""
    max_samples: int | None = None
    """Keep only the first N prompts (after mixing)."""
    input_key: str = "prompt"
    """Row key of the prompt (a string or OpenAI chat messages)."""
    label_key: str = "label"
    """Row key of the label given to the agent."""
    tools_key: str = "tools"
    """Row key of OpenAI tool schemas (optional)."""
    image_key: str = "images"
    """Row key of the prompt's images (paths, file:// or data URLs, bytes), for vision-language models."""
    max_images_per_prompt: int = 0
    """A row with more images is an error (0: no limit)."""
    max_len: int | None = None
    """Max tokens of a rollout's context (vLLM's max_model_len; None: the model's own context length)."""


@dataclass
class EnvConfig:
    id: str = ""
    """Environments of a hub by name, HUB:ID (reasoning_gym, gem, textarena, skyrl_gym, openenv, verifiers),
    instead of an agent file; several, comma-separated, are mixed (molt.envs)."""
    args: str = ""
    """Keyword arguments of the environment as a JSON object (several ids: a JSON list, one object per id)."""
    probs: str = ""
    """Mixing probabilities of the env.id entries, comma-separated (empty: equal)."""
    train_size: int = 1000
    """Tasks generated for training where the environment generates them (reasoning_gym, gem, textarena)."""
    eval_size: int = 0
    """Held-out tasks generated for evaluation (another seed), evaluated per environment (0: none)."""


@dataclass
class MultiAgentConfig:
    roles: str = ""
    """Agent roles, comma-separated: a request names its role by its `model` field or an `x-molt-role` header;
    each role gets its own reward and advantages (docs/algo.md, "Several agents")."""
    train_roles: str = ""
    """The roles that learn, comma-separated (empty: all); the others are recorded and served, not trained."""
    adapters: bool = False
    """One LoRA adapter per role that learns, on one base model (needs actor.lora_rank): a role's requests
    generate with its adapter and its tokens train it alone; the other roles generate with the base."""

    def adapter_names(self) -> list[str]:
        """The LoRA adapters of the policy: one per role that learns, or none (the one adapter of PEFT)."""
        return [r for r in (self.train_roles or self.roles).split(",") if r] if self.adapters else []


@dataclass
class EvalConfig:
    dataset: str = ""
    """Held-out prompts (JSONL); empty disables evaluation."""
    steps: int = 0
    """Evaluate every N steps (0: only before and after training)."""
    n_samples_per_prompt: int = 4
    """Samples per eval prompt (pass@n, avg@n)."""
    temperature: float = 1.0
    """Eval sampling temperature."""
    top_p: float | None = None
    """Eval nucleus mass (None: rollout.top_p)."""
    max_new_tokens: int | None = None
    """Eval max new tokens per model call (None: rollout.max_new_tokens)."""
    split: str = "train"
    """Split of the eval dataset."""
    only: bool = False
    """Evaluate and exit without training."""


@dataclass
class CkptConfig:
    output_dir: str = "runs/molt"
    """Run directory: config, metrics, dumps, checkpoints."""
    save_steps: int = 0
    """Checkpoint every N steps (0: by time only, save_interval_s)."""
    save_interval_s: float = 300.0
    """Also checkpoint after a step ending this long after the last checkpoint (0: off); the last step always."""
    resume: bool = True
    """Resume from the latest checkpoint in output_dir when there is one."""
    export_hf: bool = True
    """Export the final policy as a Hugging Face checkpoint into <output_dir>/policy."""
    path: str = ""
    """Checkpoint directory (empty: <output_dir>/checkpoints)."""
    max_num: int = 3
    """Checkpoints kept, the oldest removed first (0: all)."""
    save_hf: bool = False
    """Also export the policy as a Hugging Face checkpoint into each checkpoint (<step>/hf)."""
    best_metric_key: str = ""
    """Never remove the checkpoint with the highest value of this metric (e.g. eval_test_pass1)."""


@dataclass
class WandbConfig:
    project: str = ""
    """W&B project (empty: W&B off)."""
    key: str = ""
    """W&B API key (empty: the logged-in account)."""
    org: str = ""
    """W&B entity."""
    group: str = ""
    """W&B run group."""
    run_name: str = ""
    """W&B run name."""


@dataclass
class LoggerConfig:
    tensorboard_dir: str = ""
    """TensorBoard directory (empty: <output_dir>/tb)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class RewardConfig:
    clip_range: tuple[float, float] = (-10.0, 10.0)
    """Rewards are clamped into [low, high] before advantages (the reference's default band)."""


@dataclass
class RayConfig:
    address: str = ""
    """Existing Ray cluster address (empty: start a local instance)."""
    num_cpus: int = 0
    """Logical CPUs of a local instance (0: Ray's default)."""


@dataclass
class MoltConfig:
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    ref: ModelRefConfig = field(default_factory=ModelRefConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    data: DataConfig = field(default_factory=DataConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    multiagent: MultiAgentConfig = field(default_factory=MultiAgentConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def vllm_options(self) -> dict[str, Any]:
        """`VLLMEngine` keyword arguments of this run: vllm.*, data.max_len as max_model_len, the engine_args (the
        reference's --vllm.* knobs among them, molt.flags) read as YAML, and route capture for routing replay
        (vLLM >= 0.21: CompletionOutput.routed_experts, docs/moe.md)."""
        import yaml

        v = self.vllm
        return {
            "tensor_parallel_size": v.tensor_parallel_size,
            "max_model_len": self.data.max_len,
            "gpu_memory_utilization": v.gpu_memory_utilization,
            **{k: yaml.safe_load(x) for k, x in v.engine_args.items()},
            **({"enable_return_routed_experts": True} if self.train.routing_replay else {}),
        }
