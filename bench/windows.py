"""Hand-built training windows for the trainer benchmarks (imported from beside them: each puts `bench/` on its
path by being run from it)."""

from __future__ import annotations

from typing import Any


def experience(
    rollout_id: str,
    group_id: str,
    prompt: list[int],
    reply: list[int],
    advantages: Any,
    behavior: float = -8.0,
):
    """One segment of `prompt` then `reply`, the reply's tokens the actions, each with behavior log-prob
    `behavior` and policy version 0; `advantages`: the rollout's one value, or one per token of prompt + reply."""
    from molt.types import Experience

    n = len(reply)
    return Experience(
        rollout_id=rollout_id,
        group_id=group_id,
        segment_index=0,
        reward=0.0,
        num_tokens=len(prompt) + n,
        num_actions=n,
        min_version=0,
        token_ids=prompt + reply,
        action_mask=[0] * len(prompt) + [1] * n,
        behavior_logprobs=[behavior] * n,
        versions=[0] * n,
        advantages=advantages,
    )
