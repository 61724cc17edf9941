"""One optimizer step of Molt's actor against one of TRL's `GRPOTrainer` on the same batch (issue 45, item 3):
are the loss, the gradient and the AdamW step the same, so that a difference in learning between
`bench/vs_trl.py`'s runs is down to what each samples, not to how each trains?

For each batch seed: TRL (configured by `bench/vs_trl.py`'s `trl_config`, fp32) samples its own batch of 2 math
prompts x 8 completions with `model.generate` and scores it (its group-normalized advantages); its loss is
backpropagated, the gradients are clipped to 1.0 and its AdamW takes one step. Molt's `Actor` (the vs-TRL
workload's fields: PPO clip (0.2, 0.28), lr 5e-6 constant, clipping 1.0, fp32) is given exactly those tokens
(prompt without padding + the completion up to and with its EOS) and TRL's advantages, behavior log-probs from
its own forward (so every importance weight is 1, as TRL's ratio is with one iteration), and takes one
`train_step`, once packed (`fsdp.packing_samples`, as in the vs-TRL systems) and once padded. Reported: both
losses, both gradient norms before clipping, the largest relative difference of one parameter's gradient, the
cosine of the whole gradients, and the largest difference of a weight after the step, in units of the learning
rate: AdamW's first step moves a weight by g / (|g| + 1e-8) lr, about one lr, so a weight whose gradient is
within float noise of 0 can move differently by up to 2 lr, while the root mean square says how the step as a
whole differs.

    .venv/bin/python bench/trl_gradient.py [--batches 0,1,2] [--write]

Needs TRL (`pip install -e .[bench]`), as `bench/vs_trl.py`'s trl system does.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import vs_trl


def trl_step(path: str, seed: int, work: Path) -> tuple[dict, float, dict, dict]:
    """TRL's batch (its inputs), its loss, its gradients and its weights after one clipped AdamW step."""
    torch.manual_seed(seed)
    args = vs_trl.trl_config(1, seed, work)
    trainer = vs_trl.trl_trainer(path, vs_trl.read_jsonl(vs_trl.TRAIN), vs_trl.load_grade(), args)
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by `Trainer.train`, which this step goes around
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    trainer.create_optimizer()
    torch.nn.utils.clip_grad_norm_(model.parameters(), trainer.args.max_grad_norm)
    trainer.optimizer.step()
    return inputs, float(loss.detach()), grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def molt_step(path: str, inputs: dict, packed: bool) -> tuple[dict, dict, dict]:
    """Molt's actor on TRL's batch: its window metrics, its gradients before clipping, its weights after."""
    from windows import experience

    from molt.trainer import Actor, parallel

    actor = Actor.from_pretrained(
        path,
        **{
            "fsdp.device": "cpu",
            "fsdp.packing_samples": packed,
            "actor.adam.lr": vs_trl.LR,
            "actor.adam.weight_decay": 0.0,
            "actor.max_norm": 1.0,
            "actor.eps_clip_low_high": (0.2, 0.28),
            "actor.policy_loss": "ppo",
            "actor.entropy_coef": 0.0,
            "actor.dtype": "float32",
        },
    )
    exps = []
    for i, advantage in enumerate(inputs["advantages"].tolist()):
        prompt = inputs["prompt_ids"][i][inputs["prompt_mask"][i].bool()].tolist()
        reply = inputs["completion_ids"][i][inputs["completion_mask"][i].bool()].tolist()
        exps.append(experience(f"r{i}", "g", prompt, reply, advantage))
    for e, lp in zip(exps, actor.compute_logprobs(exps)):  # per token of the sequence; the actions' are kept
        e.behavior_logprobs = np.asarray(lp, dtype=np.float32)[np.asarray(e.action_mask, dtype=bool)]
    grads, clip = {}, parallel.clip_grad_norm

    def keep_grads(params, max_norm):  # the gradients as the window left them, before clipping
        grads.update({n: full(p.grad) for n, p in actor.model.named_parameters()})
        return clip(params, max_norm)

    parallel.clip_grad_norm = keep_grads
    try:
        metrics = actor.train_step(exps)
    finally:
        parallel.clip_grad_norm = clip
    weights = {n: full(p) for n, p in actor.model.named_parameters()}
    return metrics, grads, weights


def full(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor: a DTensor's (FSDP2 shards where a run has several ranks) or the tensor itself."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def compare(trl: dict, molt: dict) -> tuple[float, float, float, float]:
    """(TRL's norm, Molt's norm, largest per-parameter relative difference, cosine), matched by name."""
    molt = {n.removeprefix("lm."): t for n, t in molt.items()}  # Molt's actor wraps the HF model as `lm`
    if set(trl) != set(molt):
        raise RuntimeError(f"parameters differ: {sorted(set(trl) ^ set(molt))[:5]}")
    a = torch.cat([trl[n].flatten().double() for n in trl])
    b = torch.cat([molt[n].flatten().double() for n in trl])
    rel = max(float((trl[n] - molt[n]).norm() / trl[n].norm().clamp(min=1e-30)) for n in trl)
    return float(a.norm()), float(b.norm()), rel, float(a @ b / (a.norm() * b.norm()))


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batches", default="0,1,2", help="comma-separated seeds, one batch each")
    p.add_argument("--write", action="store_true", help="append the table to docs/benchmarks.md")
    args = p.parse_args()
    from molt.models import resolve_model

    path = str(resolve_model(vs_trl.MODEL))
    lines = [
        (
            "| batch seed | layout | reply tokens | loss TRL / Molt | grad norm TRL / Molt | largest relative "
            "difference of a parameter's gradient | cosine | weight difference after the step, rms / largest (lr) |"
        ),
        "| ---: | --- | ---: | --- | --- | ---: | ---: | ---: |",
    ]
    for seed in [int(s) for s in args.batches.split(",")]:
        with tempfile.TemporaryDirectory() as work:
            inputs, loss, grads, after = trl_step(path, seed, Path(work))
        for packed in (True, False):
            metrics, molt_grads, molt_after = molt_step(path, inputs, packed)
            norm_t, norm_m, rel, cos = compare(grads, molt_grads)
            diff = torch.cat([(after[n] - molt_after["lm." + n]).flatten().double() for n in after])
            rms, most = float(diff.square().mean().sqrt()) / vs_trl.LR, float(diff.abs().max()) / vs_trl.LR
            lines.append(
                f"| {seed} | {'packed' if packed else 'padded'} | {int(inputs['completion_mask'].sum())} | "
                f"{loss:.6f} / {metrics['policy_loss']:.6f} | {norm_t:.5f} / {norm_m:.5f} | {rel:.1e} | "
                f"{cos:.7f} | {rms:.1e} / {most:.2f} |"
            )
            print(lines[-1], flush=True)
    out = "\n".join(lines)
    print("\n" + out)
    if args.write:
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        command = "bench/trl_gradient.py " + " ".join(sys.argv[1:])
        with open(ROOT / "docs/benchmarks.md", "a") as f:
            f.write(
                f"\n## One step of Molt's actor against TRL's on the same batch (`bench/trl_gradient.py`)\n\n"
                f"Command: `.venv/bin/python {command.strip()}`, {stamp}, {vs_trl.environment()}.\n\n{out}\n"
            )


if __name__ == "__main__":
    main()
