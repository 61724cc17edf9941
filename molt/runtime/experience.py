"""From a captured trajectory to experiences, and from experiences to data-parallel ranks.

The producing worker turns each segment into an `Experience` and hands each payload (`Experience.split`) back
as a streamed Ray return, which the caller owns (`RolloutWorker.run`, `Workers.run`): the `RolloutOutcome`
that travels to the controller carries only light fields and object references. `assign_to_ranks` balances
token counts over data-parallel ranks (longest first onto the least-loaded rank), so each rank `reload()`s
only its own experiences.
"""

from __future__ import annotations

import heapq
from dataclasses import fields

from molt.runtime.pool import RolloutOutcome
from molt.types import Experience, Trajectory


def outcome_from_trajectory(traj: Trajectory) -> RolloutOutcome:
    """The rollout's light fields and one experience per segment (none for a failed rollout)."""
    experiences = [Experience.from_segment(traj, i) for i in range(len(traj.segments))] if traj.ok else []
    return RolloutOutcome(
        **{f.name: getattr(traj, f.name) for f in fields(Trajectory) if f.name != "segments"},
        experiences=experiences,
        break_reasons=[s.break_reason for s in traj.segments],
        response_tokens=sum(e.num_actions for e in experiences),
    )


def assign_to_ranks(experiences: list[Experience], n_ranks: int) -> list[list[Experience]]:
    """Balanced token counts per rank (LPT over rollouts: a rollout's segments stay on one rank, so token-level
    estimators see its whole action sequence). Every rank gets at least one rollout."""
    if n_ranks < 1:
        raise ValueError(f"n_ranks must be >= 1 (got {n_ranks})")
    units: dict[str, list[Experience]] = {}
    for exp in experiences:
        units.setdefault(exp.rollout_id, []).append(exp)
    if len(units) < n_ranks:
        raise ValueError(
            f"{len(units)} rollouts cannot feed {n_ranks} data-parallel ranks (a rollout's segments "
            "stay together): raise rollout.batch_size or n_samples_per_prompt, or lower train.num_ranks"
        )
    groups = list(units.values())
    heap = [(0, rank) for rank in range(n_ranks)]
    out: list[list[Experience]] = [[] for _ in range(n_ranks)]
    for unit in sorted(groups, key=lambda u: sum(e.num_tokens for e in u), reverse=True):
        load, rank = heapq.heappop(heap)
        out[rank] += unit
        heapq.heappush(heap, (load + sum(e.num_tokens for e in unit), rank))
    return out
