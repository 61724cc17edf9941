"""On-policy distillation on CPU: the student's held-out reverse KL to the teacher, checkpoint by checkpoint.

The setting of `tests/runtime/test_distill.py` (whose helpers this uses): a tiny random Llama (`molt.testing`)
tuned 10 steps on "The sum is N." answers is the student, the same base tuned 40 steps the teacher; `molt
train`'s loop (Ray rollout workers, the built-in one-turn agent, the FSDP2 trainer with the teacher as the
reference model) distills for `--steps` steps, saving a Hugging Face checkpoint every `--eval-every` steps.
Each checkpoint is then scored independently with plain transformers forwards: the exact KL(student || teacher)
of the next-token distributions along completions the student samples on the held-out prompts
(`recipes/math/data/single_test.jsonl`, `--eval-samples` completions each, fixed seed).

    .venv/bin/python bench/distill.py [--steps 16] [--prompts 8] [--samples 8] [--lr 1e-3] [--staleness 1]
        [--return-to-go] [--eval-every 2]   (results and their reading: docs/modes.md, on-policy distillation)

With `--student` and `--teacher` (model names or checkpoint directories sharing a tokenizer) the pair is those
instead, for example SmolLM2-135M-Instruct distilled from its own SFT export (`molt sft --config
recipes/sft/recipe.yaml`, which answers "3 + 2 = 5." where the base model writes a paragraph):

    .venv/bin/python bench/distill.py --student smollm2-135m-instruct --teacher runs/sft/policy --max-new 32 ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "runtime"))  # the test's helpers: one definition of the measure


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (rollout.batch_size)")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (rollout.n_samples_per_prompt)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--scheduler", default="cosine")
    p.add_argument("--staleness", type=int, default=1, help="train.max_staleness (0: synchronous)")
    p.add_argument(
        "--return-to-go",
        action="store_true",
        help="each token's signal is the sum of the per-token KLs from it to the end (reinforce_baseline "
        "with the teacher's k1 as token reward, unwhitened) instead of its own KL",
    )
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--eval-samples", type=int, default=16)
    p.add_argument("--out", default="/tmp/molt-bench-distill")
    p.add_argument("--student", default="", help="student model (default: the tiny tuned pair of the test)")
    p.add_argument("--teacher", default="", help="teacher model, with --student")
    p.add_argument(
        "--max-new", type=int, default=12, help="rollout.max_new_tokens and the evaluation's length"
    )
    p.add_argument("--warmup", type=int, default=0, help="actor.lr_warmup_steps")
    a = p.parse_args()

    import ray
    from test_distill import DATA, heldout_reverse_kl, tuned

    from molt.config import MoltConfig
    from molt.config_validate import validate
    from molt.models import resolve_model
    from molt.runtime.loop import run_training
    from molt.testing.models import build_tiny_llama

    out = Path(a.out)
    if a.student:
        student, teacher = resolve_model(a.student), resolve_model(a.teacher)
    else:
        base = build_tiny_llama(out / "base")
        student, teacher = tuned(base, out / "student", 10), tuned(base, out / "teacher", 40)  # deterministic
    cfg = MoltConfig()
    cfg.actor.model_name_or_path, cfg.ref.model_name_or_path = str(student), str(teacher)
    cfg.actor.adam.lr, cfg.actor.lr_scheduler, cfg.actor.lr_warmup_steps = a.lr, a.scheduler, a.warmup
    cfg.algo.advantage.estimator = "on_policy_distill"
    if a.return_to_go:  # the same signal through the generic KL-as-token-reward path, summed to the end
        cfg.algo.advantage.estimator, cfg.algo.advantage.no_whiten = "reinforce_baseline", True
        cfg.algo.kl.use_loss, cfg.algo.kl.estimator, cfg.algo.kl.init_coef = False, "k1", 1.0
        agent = out / "generate_agent.py"
        out.mkdir(parents=True, exist_ok=True)
        agent.write_text(
            "from molt.agents.loader import Generate\nfrom molt.agents.runners import StepEnvRunner\n\n\n"
            "class AgentRunner(StepEnvRunner):\n    def __init__(self):\n"
            "        super().__init__(Generate, max_turns=1)\n"
        )
        cfg.train.agent_path = str(agent)
    cfg.data.prompt_dataset = str(DATA / "single_train.jsonl")
    cfg.train.max_steps, cfg.train.max_staleness = a.steps, a.staleness
    cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt, cfg.rollout.max_new_tokens = (
        a.prompts,
        a.samples,
        a.max_new,
    )
    cfg.ckpt.output_dir, cfg.ckpt.save_steps, cfg.ckpt.save_hf, cfg.ckpt.max_num = (
        str(out / "run"),
        a.eval_every,
        True,
        0,
    )
    for attempt in range(5):  # Ray gives a new node 30 s to start, which a loaded 2-core machine can miss
        try:
            ray.init(
                "local",
                num_cpus=4,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
                runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}},
            )
            break
        except Exception:
            ray.shutdown()
            if attempt == 4:
                raise
    t0 = time.perf_counter()
    asyncio.run(run_training(validate(cfg)))
    seconds = time.perf_counter() - t0
    ray.shutdown()

    prompts = [json.loads(line)["prompt"][0]["content"] for line in (DATA / "single_test.jsonl").open()]
    steps = range(0, a.steps + 1, a.eval_every)
    kls = [
        heldout_reverse_kl(
            out / "run" / "checkpoints" / f"step_{s}" / "hf" if s else student,
            teacher,
            prompts,
            samples=a.eval_samples,
            max_new=a.max_new,
        )
        for s in steps
    ]
    train_kl = [m["kl/mean"] for m in map(json.loads, (out / "run" / "metrics.jsonl").open())]
    print(
        json.dumps(
            {
                "args": vars(a),
                "train_seconds": round(seconds),
                "load": os.getloadavg()[0],
                "steps": list(steps),
                "heldout_kl": [round(k, 3) for k in kls],
                "train_kl": [round(k, 3) for k in train_kl],
            }
        )
    )


if __name__ == "__main__":
    main()
