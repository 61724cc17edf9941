"""Molt against TRL's `GRPOTrainer` on one CPU workload (issue 7, item 4). Prints a table; `--write` appends it to
docs/benchmarks.md with the command and the date.

    .venv/bin/python bench/vs_trl.py [--steps 60] [--systems molt-sync,molt-async,trl] [--seed 42] [--write]

TRL is optional and not part of Molt's default install. Install the `bench` extra (`pip install -e .[bench]`) or
directly `pip install trl datasets`, keeping torch and transformers where they are (for example
`pip install trl datasets -c constraints.txt` with `torch==<installed>` and `transformers==<installed>` in it).
The Molt systems run without it; `--systems trl` refuses with that hint when it is missing.

The workload, identical for every system:
- model `smollm2-135m-instruct` (resolved by `molt.models.resolve_model`), fp32 weights (the bf16 systems compute
  in bf16), on CPU;
- prompts: recipes/math single-digit sums, 80 training pairs, 20 held out (chat messages, the model's template);
- 2 prompts x 8 samples per optimizer step (group size 8), 48 new tokens, temperature 1, top-p 1, no top-k;
- AdamW, learning rate 5e-6 constant, no warm-up, weight decay 0, gradient clipping 1.0, no KL (no reference
  model), group-normalized advantages (r - mean) / std, token-mean loss over the step, PPO clip (0.2, 0.28) (the
  ratio is 1 in both: one optimizer step per batch; Molt's stale samples get the behavior importance weight,
  `algo.advantage.is_correction_*`, instead), one optimizer step per batch;
- reward: `grade` from recipes/math/agent.py (1 when the last number of the reply equals the sum);
- the same number of optimizer steps.

Systems (run one after the other, in this order, in one process):
- `molt-sync`: the recipe with `--train.max_staleness 0` (generation and training alternate);
- `molt-async`: `--train.max_staleness 1` (generation of the next step overlaps training); `molt-async2`: staleness 2;
  `molt-async-packed`: staleness 1 with `--fsdp.packing_samples` (packed micro-batches, so no shared prefixes);
  `molt-async-partial`: the same with `--train.partial_rollout_enable` (a refit pauses the engine for the new
  weights instead of waiting for the completions in flight); `molt-vllm`: molt-async-packed with
  `--rollout.engine vllm` (vLLM's CPU build; run it from `.venv-vllm`, `make vllm`, where TRL need not be
  installed: its TRL row then comes from a separate `.venv` invocation); `molt-bf16`: molt-async-packed with
  `--actor.dtype bfloat16` (the trainer's forward and backward in bf16, fp32 master weights; the engine stays fp32);
  `molt-bf16-all`: molt-bf16 with `--rollout.dtype bfloat16` as well (the embedded engine samples in bf16);
  `molt-bf16-sync`: molt-bf16-all with `--train.max_staleness 0`; `molt-bf16-engine`: molt-async-packed with
  `--rollout.dtype bfloat16` alone (the engine in bf16, the trainer in fp32);
- `trl`: `trl.GRPOTrainer` with `GRPOConfig(per_device_train_batch_size=16, num_generations=8,
  gradient_accumulation_steps=1, ...)`, `use_cpu=True`, no vLLM, `num_iterations=1`, `beta=0`; `trl-bf16`: the
  same with `bf16=True` (the Trainer's CPU autocast, fp32 master weights). "vs TRL" is against `trl`.

Measures:
- train s: wall time of the optimizer steps only (sum of Molt's `timing/step_total`; for TRL the time from each
  `on_step_begin` to its `on_step_end`, which holds generation, reward and the update). Model loading, the
  evaluations and the export are outside it. s/step = train s / steps.
- tokens/s: completion tokens of the trained rollouts / train s (Molt: `rollout/response_length_mean` x
  `rollout/count` per step; TRL: `completions/mean_length` x 16 per step).
- held-out accuracy, one shared evaluation for every model (`shared_eval`): 4 samples per held-out problem at
  temperature 1 (top-p 1, no top-k), 48 new tokens, padded `model.generate` over the chat-templated prompts with a
  fixed seed, graded by `grade`, mean over the 80 samples. The base model is evaluated once; each system's final
  policy is evaluated with the same seed. Molt's final policy is exported with the trainer's `export_hf` (the
  script drives `molt.runtime.loop.Run` exactly as `run_training` does, plus that export). Molt's own recipe
  evaluation (eval.n_samples_per_prompt 4, through its engine and agent) is reported as well.
- the curve: held-out accuracy every `--eval-every` steps (default 10), outside the train time: for TRL the shared
  evaluation of the model in training, for Molt its own evaluation (the same sampling: 4 samples per held-out
  problem, temperature 1, 48 tokens, through its engine and the recipe's agent). "train s to 0.8" is the train
  time at the first evaluation at or above 0.8.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECIPE = ROOT / "recipes/math/recipe.yaml"
TRAIN = ROOT / "recipes/math/data/single_train.jsonl"
TEST = ROOT / "recipes/math/data/single_test.jsonl"
AGENT = ROOT / "recipes/math/agent.py"
MODEL = "smollm2-135m-instruct"

# The shared workload.
PROMPTS_PER_STEP = 2
GROUP = 8
MAX_NEW_TOKENS = 48
TEMPERATURE = 1.0
LR = 5e-6
EVAL_SAMPLES = 4

# name -> its fields over the shared workload (the workload's own: staleness 1, padded rows, no partial rollout,
# the embedded engine, fp32 engine and trainer), as the command line names them
PACKED = {"fsdp.packing_samples": True}
BF16 = {**PACKED, "actor.dtype": "bfloat16"}
BF16_ALL = {**BF16, "rollout.dtype": "bfloat16"}
SYSTEMS = {
    "molt-sync": {"train.max_staleness": 0},
    "molt-async": {},
    "molt-async2": {"train.max_staleness": 2},
    "molt-async-packed": PACKED,
    "molt-async-partial": {**PACKED, "train.partial_rollout_enable": True},
    "molt-vllm": {**PACKED, "rollout.engine": "vllm"},
    "molt-bf16": BF16,
    "molt-bf16-all": BF16_ALL,
    "molt-bf16-engine": {**PACKED, "rollout.dtype": "bfloat16"},
    "molt-bf16-sync": {**BF16_ALL, "train.max_staleness": 0},
}
# TRL's systems: name -> GRPOConfig.bf16 (autocast of its forward and backward, fp32 master weights)
TRL_SYSTEMS = {"trl": False, "trl-bf16": True}


def load_grade():
    """`grade` from the recipe's agent file (the module imports `molt.agents`, so Molt must be importable)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("molt_bench_math_agent", AGENT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.grade


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------------ evaluation
def shared_eval(model, tokenizer, rows: list[dict], grade, seed: int, n: int = EVAL_SAMPLES) -> float:
    """avg@n on `rows`: n samples per prompt at temperature 1, graded by `grade`; seeded, so the same model gives
    the same figure and different models meet the same random stream."""
    import torch

    tokenizer.padding_side = "left"
    prompts = [
        tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows
    ]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    was_training = model.training
    model.eval()
    # its own random stream: a TRL run evaluated every N steps trains on the stream it would have without evals
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(seed)
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=TEMPERATURE,
            top_p=1.0,
            top_k=0,
            max_new_tokens=MAX_NEW_TOKENS,
            num_return_sequences=n,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    model.train(was_training)
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    labels = [r["label"] for r in rows for _ in range(n)]  # num_return_sequences repeats each prompt n times
    return statistics.fmean(grade(t, label) for t, label in zip(texts, labels))


def eval_checkpoint(path: str, rows: list[dict], grade, seed: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    try:
        return shared_eval(model, tokenizer, rows, grade, seed)
    finally:
        del model


# ------------------------------------------------------------------------------------------------ Molt
def molt_config(system: dict, steps: int, seed: int, out_dir: Path, eval_every: int = 0):
    """The math recipe with the shared workload pinned explicitly (so a recipe edit cannot drift the bench), then
    the system's fields (`SYSTEMS`)."""
    from molt.cli import load_config
    from molt.config_resolve import override
    from molt.config_validate import validate

    cfg = load_config(["--config", str(RECIPE)], check_files=False)
    cfg.actor.model_name_or_path = MODEL
    cfg.actor.adam.lr = LR
    cfg.actor.adam.weight_decay = 0.0
    cfg.actor.lr_scheduler, cfg.actor.lr_warmup_steps = "constant", 0
    cfg.actor.max_norm = 1.0
    cfg.actor.dtype = "float32"  # the compute dtype; the master weights stay fp32 in every system
    cfg.actor.eps_clip_low_high = (0.2, 0.28)
    cfg.actor.policy_loss = "ppo"
    cfg.actor.entropy_coef = 0.0
    cfg.algo.advantage.estimator = "grpo"
    cfg.algo.kl.init_coef = 0.0
    cfg.algo.dynamic_filtering_enable = False
    cfg.train.agent_path = str(AGENT)
    cfg.train.max_steps = steps
    cfg.train.max_staleness = 1
    cfg.train.partial_rollout_enable = False
    cfg.train.seed = seed
    cfg.train.batch_size = 0  # every rollout of a step in one optimizer step
    cfg.rollout.batch_size = PROMPTS_PER_STEP
    cfg.rollout.n_samples_per_prompt = GROUP
    cfg.rollout.max_new_tokens = MAX_NEW_TOKENS
    cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k = TEMPERATURE, 1.0, -1
    cfg.rollout.engine, cfg.rollout.dtype = "hf", "float32"
    cfg.data.prompt_dataset = str(TRAIN)
    cfg.data.input_key, cfg.data.label_key = "prompt", "label"
    cfg.eval.dataset = str(TEST)
    cfg.eval.n_samples_per_prompt = EVAL_SAMPLES
    cfg.eval.temperature = TEMPERATURE
    cfg.eval.steps = eval_every  # 0: before and after only
    cfg.fsdp.packing_samples = False
    cfg.ckpt.output_dir = str(out_dir)
    cfg.ckpt.save_steps = 0
    cfg.ckpt.resume = False
    cfg.ckpt.export_hf = True
    cfg.train.dump_trajectories_steps = 0
    return validate(override(cfg, system))


def run_molt(name: str, steps: int, seed: int, work: Path, test_rows, grade, eval_every: int) -> dict:
    from molt.runtime.metrics import read_metrics

    out_dir = work / name
    export_dir = out_dir / "policy"  # the run exports its final policy there (ckpt.export_hf)
    for d in (out_dir, export_dir):
        shutil.rmtree(d, ignore_errors=True)
    cfg = molt_config(SYSTEMS[name], steps, seed, out_dir, eval_every)
    print(f"\n=== {name}: Molt, {SYSTEMS[name] or 'the shared workload'}, run dir {out_dir}", flush=True)
    t0 = time.perf_counter()
    from molt.runtime.loop import run_training

    summary = asyncio.run(run_training(cfg))
    total = time.perf_counter() - t0
    rows = [m for m in read_metrics(out_dir) if "timing/step_total" in m]
    if len(rows) != steps:
        raise RuntimeError(f"{name}: {len(rows)} training steps in metrics.jsonl, expected {steps}")
    train_s = sum(m["timing/step_total"] for m in rows)
    tokens = sum(m["rollout/response_length_mean"] * m["rollout/count"] for m in rows)
    print(f"{name}: trained {steps} steps in {train_s:.1f} s; evaluating the exported policy", flush=True)
    final = eval_checkpoint(str(export_dir), test_rows, grade, seed)
    elapsed = [sum(m["timing/step_total"] for m in rows[:k]) for k in range(steps + 1)]
    curve = [(e["step"], e["accuracy"], elapsed[e["step"]]) for e in summary["evals"]]
    return {
        "system": name,
        "curve": curve,
        "steps": summary["steps"],
        "train_s": train_s,
        "tokens": tokens,
        "gen_s": sum(m["timing/generation"] for m in rows),
        "upd_s": sum(m["timing/policy_train"] for m in rows),
        "final": final,
        "own_base": summary["base_eval_accuracy"],
        "own_final": summary["final_eval_accuracy"],
        "reward": statistics.fmean(m["rollout/reward_mean"] for m in rows),
        "staleness": statistics.fmean(m.get("rollout/staleness_mean", 0.0) for m in rows),
        "wall_s": total,
    }


# ------------------------------------------------------------------------------------------------ TRL
def _is_number(value) -> bool:
    try:
        float(value)
        return True
    except (TypeError, ValueError):
        return False


def trl_config(steps: int, seed: int, out_dir: Path, bf16: bool = False):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out_dir),
        # one optimizer step = one generation batch = 2 prompts x 8 completions
        per_device_train_batch_size=PROMPTS_PER_STEP * GROUP,
        gradient_accumulation_steps=1,
        num_generations=GROUP,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=MAX_NEW_TOKENS,
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        scale_rewards="group",
        mask_truncated_completions=False,
        use_vllm=False,
        use_cpu=True,
        bf16=bf16,
        fp16=False,
        activation_checkpointing=False,
        max_steps=steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        log_completions=False,
        seed=seed,
        data_seed=seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )


def trl_trainer(model_path: str, train_rows, grade, args, callbacks=()):
    """TRL's `GRPOTrainer` on the workload: the fp32 model, the recipe's `grade` as its reward, the training rows,
    `args` (`trl_config`)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    def math_reward(completions, label, **kwargs):
        """The recipe's `grade` over TRL completions (conversational: a list holding the assistant message)."""
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [grade(t, y) for t, y in zip(texts, label)]

    return GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
        reward_funcs=math_reward,
        args=args,
        train_dataset=Dataset.from_list([{"prompt": r["prompt"], "label": r["label"]} for r in train_rows]),
        processing_class=AutoTokenizer.from_pretrained(model_path),
        callbacks=list(callbacks),
    )


def run_trl(
    name: str,
    steps: int,
    seed: int,
    work: Path,
    model_path: str,
    train_rows,
    test_rows,
    grade,
    eval_every: int,
) -> dict:
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.step_s: list[float] = []
            self.logs: list[dict] = []
            self._t0 = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
            self.step_s.append(time.perf_counter() - self._t0)
            if eval_every and state.global_step % eval_every == 0:  # outside the timed step
                curve.append(
                    (
                        state.global_step,
                        shared_eval(model, processing_class, test_rows, grade, seed),
                        sum(self.step_s),
                    )
                )

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                self.logs.append(
                    {
                        k: float(v)
                        for k, v in logs.items()
                        if isinstance(v, (int, float, str)) and _is_number(v)
                    }
                )

    out_dir = work / name
    shutil.rmtree(out_dir, ignore_errors=True)
    print(f"\n=== {name}: GRPOTrainer on CPU, bf16 {TRL_SYSTEMS[name]}, output dir {out_dir}", flush=True)
    t0 = time.perf_counter()
    clock = Clock()
    curve = [(0, None, 0.0)]  # the base model's figure is the shared one, filled in by the caller
    args = trl_config(steps, seed, out_dir, TRL_SYSTEMS[name])
    trainer = trl_trainer(model_path, train_rows, grade, args, [clock])
    trainer.train()
    if len(clock.step_s) != steps or len(clock.logs) != steps:
        raise RuntimeError(
            f"{name}: {len(clock.step_s)} steps timed and {len(clock.logs)} logged, expected {steps}"
        )
    train_s = sum(clock.step_s)
    tokens = sum(log["completions/mean_length"] * PROMPTS_PER_STEP * GROUP for log in clock.logs)
    print(f"{name}: trained {steps} steps in {train_s:.1f} s; evaluating the final policy", flush=True)
    final = shared_eval(trainer.model, trainer.processing_class, test_rows, grade, seed)
    return {
        "system": name,
        "curve": curve,
        "steps": trainer.state.global_step,
        "train_s": train_s,
        "tokens": tokens,
        "gen_s": None,
        "upd_s": None,
        "final": final,
        "own_base": None,
        "own_final": None,
        "reward": statistics.fmean(log["reward"] for log in clock.logs),
        "staleness": 0.0,
        "wall_s": time.perf_counter() - t0,
    }


# ------------------------------------------------------------------------------------------------ report
def _pct(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def curves(results: list[dict], base: float, target: float = 0.8) -> str:
    """Held-out accuracy along training: one row per system, one column per evaluated step."""
    steps = sorted({s for r in results for s, _, _ in r["curve"]})
    lines = [
        "| system | " + " | ".join(f"step {s}" for s in steps) + f" | train s to {target} |",
        "| --- |" + " ---: |" * (len(steps) + 1),
    ]
    for r in results:
        at = {s: (base if a is None else a) for s, a, _ in r["curve"]}
        hit = next((t for _, a, t in r["curve"] if a is not None and a >= target), None)
        lines.append(
            f"| {r['system']} | "
            + " | ".join(_pct(at.get(s)) for s in steps)
            + f" | {'not reached' if hit is None else f'{hit:.0f}'} |"
        )
    return "\n".join(lines)


def table(results: list[dict], base: float) -> str:
    ref = next((r for r in results if r["system"] == "trl"), None)
    lines = [
        (
            "| system | steps | train s | s/step | vs TRL | gen tokens | tokens/s | mean train reward | "
            "held-out base | held-out final | gain | Molt eval base / final |"
        ),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        per_step = r["train_s"] / r["steps"]
        speed = f"{(ref['train_s'] / ref['steps']) / per_step:.2f}x" if ref else "-"
        own = "-" if r["own_base"] is None else f"{_pct(r['own_base'])} / {_pct(r['own_final'])}"
        lines.append(
            f"| {r['system']} | {r['steps']} | {r['train_s']:.1f} | {per_step:.2f} | {speed} | "
            f"{r['tokens']:.0f} | {r['tokens'] / r['train_s']:.1f} | {r['reward']:.3f} | {_pct(base)} | "
            f"{_pct(r['final'])} | {r['final'] - base:+.2f} | {own} |"
        )
    return "\n".join(lines)


def environment() -> str:
    import torch
    import transformers

    try:
        import trl

        trl_version = trl.__version__
    except ImportError:
        trl_version = "not installed"
    try:
        import vllm

        vllm_version = f", vllm {vllm.__version__}"
    except ImportError:  # the molt-vllm system only
        vllm_version = ""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl_version}{vllm_version}"
        f", {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, {platform.machine()}, "
        f"1-min load average at the end {load:.1f}"
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per system (default 60)")
    p.add_argument(
        "--systems",
        default="molt-sync,molt-async,trl",
        help=f"comma-separated, run in this order; known: {', '.join([*SYSTEMS, *TRL_SYSTEMS])}",
    )
    p.add_argument(
        "--seed", type=int, default=42, help="training seed of every system and the shared eval seed"
    )
    p.add_argument("--work-dir", default=str(ROOT / "runs/bench_vs_trl"), help="run directories and exports")
    p.add_argument(
        "--eval-every", type=int, default=10, help="held-out accuracy every N steps (0: before and after)"
    )
    p.add_argument("--write", action="store_true", help="append the table to docs/benchmarks.md")
    args = p.parse_args()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS and s not in TRL_SYSTEMS]
    if unknown or not systems:
        p.error(f"unknown systems {unknown}; known: {', '.join([*SYSTEMS, *TRL_SYSTEMS])}")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if set(systems) & set(TRL_SYSTEMS):
        try:
            import datasets  # noqa: F401
            import trl  # noqa: F401
        except ImportError:
            p.error("the trl system needs TRL: pip install -e .[bench]  (or: pip install trl datasets)")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from molt.models import resolve_model

    grade = load_grade()
    train_rows, test_rows = read_jsonl(TRAIN), read_jsonl(TEST)
    model_path = str(resolve_model(MODEL))
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    started = datetime.now(timezone.utc)

    print(
        f"shared eval of the base model ({len(test_rows)} held-out problems x {EVAL_SAMPLES} samples)",
        flush=True,
    )
    base = eval_checkpoint(model_path, test_rows, grade, args.seed)
    print(f"base held-out accuracy (shared eval): {base:.3f}", flush=True)

    results = []
    ray_started = False
    for name in systems:
        if name in SYSTEMS:
            results.append(run_molt(name, args.steps, args.seed, work, test_rows, grade, args.eval_every))
            ray_started = True
        else:
            if ray_started:  # give the cores and memory back before TRL trains in this process
                import ray

                ray.shutdown()
                ray_started = False
            results.append(
                run_trl(
                    name,
                    args.steps,
                    args.seed,
                    work,
                    model_path,
                    train_rows,
                    test_rows,
                    grade,
                    args.eval_every,
                )
            )
    if ray_started:
        import ray

        ray.shutdown()

    env = environment()
    command = "python bench/vs_trl.py " + " ".join(sys.argv[1:])
    out = (
        table(results, base)
        + "\n\nHeld-out accuracy along training (TRL: shared evaluation; Molt: its own):\n\n"
        + curves(results, base)
    )
    notes = "\n".join(
        f"- {r['system']}: generation {r['gen_s']:.1f} s and update {r['upd_s']:.1f} s inside the train time, mean "
        f"staleness {r['staleness']:.2f}; whole run incl. loading and evaluations {r['wall_s']:.0f} s"
        if r["gen_s"] is not None
        else f"- {r['system']}: whole run incl. loading and the final evaluation {r['wall_s']:.0f} s"
        for r in results
    )
    print(f"\n{out}\n\n{notes}\n\n{env}")
    if args.write:
        section = (
            f"\n## Molt against TRL GRPOTrainer (`bench/vs_trl.py`)\n\n"
            f"Command: `{'.venv-vllm' if 'molt-vllm' in systems else '.venv'}/bin/{command}` on {started:%Y-%m-%d %H:%M} UTC\n\n"
            f"smollm2-135m-instruct fp32 weights on CPU (the -bf16 systems compute in bf16), recipes/math single-digit sums (80 train, 20 held out), "
            f"{PROMPTS_PER_STEP} prompts x {GROUP} samples per step, {MAX_NEW_TOKENS} new tokens, temperature 1, "
            f"lr {LR:g} constant, no KL, seed {args.seed}. Held-out accuracy: one shared evaluation for every "
            f"model ({EVAL_SAMPLES} samples per problem at temperature 1, seeded `model.generate`, graded by the "
            f"recipe's `grade`); the last column is Molt's own recipe evaluation. train s excludes model loading and "
            f"evaluations. {env}.\n\n{out}\n\n{notes}\n"
        )
        path = ROOT / "docs/benchmarks.md"
        with open(path, "a") as f:
            f.write(section)
        print(f"appended to {path}")


if __name__ == "__main__":
    main()
