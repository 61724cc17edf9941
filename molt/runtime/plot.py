"""`molt plot RUN_DIR`: reward and held-out accuracy curves of a run, from its metrics.jsonl, into curves.png."""
from __future__ import annotations

from pathlib import Path

from molt.runtime.metrics import read_metrics


def plot_run(run_dir: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display here or on cluster nodes
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    reward = [(r["step"], r["rollout/reward_mean"]) for r in rows if "rollout/reward_mean" in r]
    acc = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if reward:
        ax.plot(*zip(*reward), label="train reward (mean)", color="tab:blue", alpha=0.8)
    if acc:
        ax.plot(*zip(*acc), "o-", label="held-out accuracy", color="tab:red")
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax.set_title(Path(run_dir).name)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    out = Path(run_dir) / "curves.png"
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
