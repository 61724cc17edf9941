"""`molt plot RUN_DIR`: reward and held-out accuracy curves of a run (train and held-out loss of `molt sft`), from
its metrics.jsonl, into curves.png."""
from __future__ import annotations

from pathlib import Path

from molt.runtime.metrics import read_metrics

SERIES = [("rollout/reward_mean", "-", "train reward (mean)", "tab:blue"),  # molt train
          ("eval/accuracy", "o-", "held-out accuracy", "tab:red"),
          ("train/loss", "-", "train loss", "tab:blue"), ("eval/loss", "o-", "held-out loss", "tab:red")]  # molt sft


def plot_run(run_dir: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display here or on cluster nodes
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for key, style, label, color in SERIES:
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            ax.plot(*zip(*points), style, label=label, color=color, alpha=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy" if any("rollout/reward_mean" in r for r in rows) else "loss (nats/token)")
    ax.set_title(Path(run_dir).name)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    out = Path(run_dir) / "curves.png"
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
