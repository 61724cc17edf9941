"""`molt plot RUN_DIR`: reward and held-out accuracy curves of a run (train and held-out loss of `molt sft`), from
its metrics.jsonl, into curves.png. Agent runs (tool calls recorded by the capture server) get a second panel:
valid tool calls, held-out valid tool calls, tool calls and segments per rollout."""

from __future__ import annotations

from pathlib import Path

from molt.runtime.metrics import read_metrics

SERIES = [
    ("rollout/reward_mean", "-", "train reward (mean)", "tab:blue"),  # molt train
    ("eval/accuracy", "o-", "held-out accuracy", "tab:red"),
    ("train/loss", "-", "train loss", "tab:blue"),
    ("eval/loss", "o-", "held-out loss", "tab:red"),
]  # molt sft


def plot_run(run_dir: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display here or on cluster nodes
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    agent = any("agent/tool_calls" in r for r in rows)
    fig, axes = plt.subplots(1, 1 + agent, figsize=(7 + 6 * agent, 4), dpi=110, squeeze=False)
    first = "reward / accuracy" if any("rollout/reward_mean" in r for r in rows) else "loss (nats/token)"
    panels = [(first, [(key, label, style) for key, style, label, _ in SERIES])]
    if agent:
        panels.append(
            (
                "per rollout",
                [
                    ("agent/tool_call_valid", "valid tool calls (fraction)", "-"),
                    ("eval/agent/tool_call_valid", "held-out valid tool calls", "o-"),
                    ("agent/tool_calls", "tool calls", "-"),
                    ("rollout/segments_per_rollout", "segments", "-"),
                ],
            )
        )
    for ax, (ylabel, lines) in zip(axes[0], panels):
        for key, label, style in lines:
            points = [(r["step"], r[key]) for r in rows if key in r]
            if points:
                ax.plot(*zip(*points), style, label=label, alpha=0.85)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
    axes[0][0].set_title(Path(run_dir).name)
    out = Path(run_dir) / "curves.png"
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
