"""Per-step metrics: computed from light rollout records, written to the console, a JSONL file and TensorBoard.

Design notes and decisions: docs/internals.md, section `molt/runtime/metrics.py`.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from molt.runtime.pool import Group


def rollout_metrics(groups: Iterable[Group], version: int) -> dict[str, float]:
    """Reward, group spread, length, truncation, segmentation and staleness of the groups of one step."""
    groups = list(groups)
    outcomes = [o for g in groups for o in g.outcomes]
    if not outcomes:
        return {}
    rewards = [o.reward for o in outcomes]
    stds = [statistics.pstdev([o.reward for o in g.outcomes]) for g in groups]
    behind = [version - e.min_version for o in outcomes for e in o.experiences if e.num_actions]
    breaks = Counter(r for o in outcomes for r in o.break_reasons)
    out = {
        "rollout/reward_mean": statistics.fmean(rewards),
        "rollout/reward_std": statistics.pstdev(rewards),
        "group_reward_std": statistics.fmean(stds),
        "rollout/response_length_mean": statistics.fmean(o.response_tokens for o in outcomes),
        "rollout/truncated_rate": statistics.fmean(float(o.truncated) for o in outcomes),
        "rollout/segments_per_rollout": statistics.fmean(max(1, len(o.experiences)) for o in outcomes),
        "rollout/staleness_mean": statistics.fmean(behind) if behind else 0.0,
        "rollout/staleness_max": float(max(behind, default=0)),
        "rollout/count": float(len(outcomes)),
    }
    out.update({f"rollout/break/{reason}": float(n) for reason, n in breaks.items()})
    for role in sorted({e.role for o in outcomes for e in o.experiences} - {""}):  # several agents
        mine = [(o, [e for e in o.experiences if e.role == role]) for o in outcomes]
        mine = [(o, exps) for o, exps in mine if exps]
        out[f"rollout/role/{role}/reward_mean"] = statistics.fmean(o.reward_of(role) for o, _ in mine)
        out[f"rollout/role/{role}/tokens"] = statistics.fmean(sum(e.num_actions for e in x) for _, x in mine)
        out[f"rollout/role/{role}/segments"] = statistics.fmean(len(x) for _, x in mine)
    for env in sorted({g.row["env"] for g in groups if "env" in g.row}):  # a run on hub environments
        mine = [o.reward for g in groups if g.row.get("env") == env for o in g.outcomes]
        out[f"rollout/env/{env}/reward_mean"] = statistics.fmean(mine)
    out.update(agent_metrics(outcomes, "agent/"))
    out.update(info_means(outcomes, "rollout/info/"))
    return out


def info_means(outcomes: list[Any], prefix: str) -> dict[str, float]:
    """The mean of each `Result.info` key (and capture counter) over the rollouts that report it."""
    keys = sorted({k for o in outcomes for k in o.info})
    return {prefix + k: statistics.fmean(float(o.info[k]) for o in outcomes if k in o.info) for k in keys}


def agent_metrics(outcomes: list[Any], prefix: str) -> dict[str, float]:
    """What an agent did per rollout, from the capture server's counters: model calls (`turns`), tool calls
    (parsed ones plus malformed attempts) and the fraction of calls that parsed and ran. "Ran" uses the agent's
    own `tool_errors` count in `Result.info` when it reports one (a call the tool refused); the capture server
    cannot know it. Env rollouts without tools report turns only."""

    def total(key: str) -> float:
        return sum(float(o.info.get(key, 0.0)) for o in outcomes)

    if not outcomes or not any("capture/requests" in o.info for o in outcomes):
        return {}
    parsed, malformed = total("capture/tool_calls"), total("capture/malformed_tool_calls")
    out = {
        f"{prefix}turns": total("capture/requests") / len(outcomes),
        f"{prefix}tool_calls": (parsed + malformed) / len(outcomes),
    }
    if parsed + malformed:
        out[f"{prefix}tool_call_valid"] = max(0.0, parsed - total("tool_errors")) / (parsed + malformed)
    return out


def pass_at_n(correct: list[list[bool]]) -> tuple[float, float]:
    """(pass@n, avg@n) over prompts, each with n samples judged correct or not."""
    if not correct:
        return 0.0, 0.0
    return (
        statistics.fmean(float(any(c)) for c in correct),
        statistics.fmean(statistics.fmean(map(float, c)) for c in correct),
    )


def _pass_at_n(prompts: list[Any], outcomes: list[Any]) -> tuple[float, float]:
    correct: dict[Any, list[bool]] = {}
    for p, o in zip(prompts, outcomes):
        correct.setdefault(p, []).append(o.ok and o.effective_score > 0)
    return pass_at_n(list(correct.values()))


def eval_metrics(
    outcomes: list[Any], prompts: list[int], name: str, n: int, envs: list[str] | None = None
) -> dict[str, float]:
    """An eval set's line: pass@n and avg@n (`prompts`: each rollout's prompt index; correct = ok with score or
    reward > 0; avg = the mean of that), failures, the agents' metrics and info means; with `envs` (each
    rollout's environment), pass@n and avg@n of each environment too."""
    pass_n, avg_n = _pass_at_n(prompts, outcomes)
    out = {
        f"eval_{name}_pass{n}": pass_n,
        f"eval_{name}_avg{n}": avg_n,
        "eval/accuracy": avg_n,
        "eval/failed": float(sum(not o.ok for o in outcomes)),
        **agent_metrics(outcomes, "eval/agent/"),
        **info_means(outcomes, "eval/info/"),
    }
    for env in sorted(set(envs or ())):
        picked = [(p, o) for p, o, e in zip(prompts, outcomes, envs) if e == env]
        pass_n, avg_n = _pass_at_n(*zip(*picked))
        out.update({f"eval/env/{env}/pass{n}": pass_n, f"eval/env/{env}/accuracy": avg_n})
    return out


def _fmt(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


# (metric key, console label) for the one-line summary, in order; missing keys are skipped.
_CONSOLE = [
    ("rollout/reward_mean", "reward"),
    ("group_reward_std", "grp_std"),
    ("eval/accuracy", "eval_acc"),
    ("train/loss", "loss"),
    ("eval/loss", "eval_loss"),
    ("rollout/response_length_mean", "len"),
    ("policy_loss", "loss"),
    ("actor_grad_norm", "gnorm"),
    ("agent/turns", "turns"),
    ("agent/tool_calls", "calls"),
    ("agent/tool_call_valid", "valid"),
    ("rollout/segments_per_rollout", "segs"),
    ("is_filter_ratio", "gate"),
    ("rollout/staleness_mean", "stale"),
    ("timing/generation", "gen_s"),
    ("timing/policy_train", "train_s"),
    ("timing/broadcast", "refit_s"),
    ("timing/step_total", "step_s"),
]
# (metric key, bound, warning): the step line ends with the warning when the metric reaches its bound
_WARNINGS = [
    ("train/skipped_steps", 1.0, "{:.0f} optimizer step(s) skipped for a non-finite loss or gradient norm"),
    (
        "is/rejected_frac",
        0.999,
        "the importance gate rejected {:.2%} of the action tokens (trainer and engine disagree)",
    ),
]


class MetricsLogger:
    def __init__(
        self,
        run_dir: str | Path,
        total_steps: int,
        *,
        tensorboard_dir: str = "",
        wandb: dict[str, str] | None = None,
        config: dict[str, Any] | None = None,
        start_step: int = 0,
    ):
        from torch.utils.tensorboard import SummaryWriter
        from tqdm.auto import tqdm

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a")  # noqa: SIM115 (open for the logger's lifetime)
        self._tb = SummaryWriter(tensorboard_dir or str(self.run_dir / "tb"))
        self._wandb = None
        w = wandb or {}
        if w.get("project"):  # W&B is optional: without the package, an API key or a network the run goes on
            try:
                import wandb as wb

                if w.get("key"):
                    wb.login(key=w["key"])
                self._wandb = wb.init(
                    project=w["project"],
                    entity=w.get("org") or None,
                    name=w.get("run_name") or None,
                    group=w.get("group") or None,
                    config=config,
                    dir=str(self.run_dir),
                )
            except Exception as e:  # noqa: BLE001 (wandb raises its own error types, and more)
                why = (
                    "wandb is not installed (pip install 'molt[wandb]')" if isinstance(e, ImportError) else e
                )
                print(f"molt: note: W&B logging is off: {why}", file=sys.stderr)
        self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, float], *, advance: bool = True) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}  # NaN and inf kept
        self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        self._jsonl.flush()
        for key, value in clean.items():
            self._tb.add_scalar(key, value, step)
        self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        parts = [f"{label} {_fmt(clean[key])}" for key, label in _CONSOLE if key in clean]
        counts = " ".join(
            f"{k.removeprefix('rollout/')} {v:.0f}"
            for k, v in clean.items()  # failures, drops and restarts so far
            if k.startswith(("rollout/failed/", "rollout/dropped/")) or (k.endswith("/restarts") and v)
        )
        parts += [counts] if counts else []
        parts += [
            f"WARNING: {text.format(clean[key])}"
            for key, bound, text in _WARNINGS
            if clean.get(key, 0.0) >= bound
        ]
        self._bar.write(f"step {step}: {' | '.join(parts)}")
        if advance:
            self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
        self._jsonl.close()
        self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(run_dir: str | Path) -> list[dict[str, float]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"no metrics.jsonl in {run_dir}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
