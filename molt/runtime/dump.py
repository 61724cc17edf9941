"""Human-readable trajectory dumps (`--train.dump_trajectories_steps`): one JSON line per segment.

Only on dump steps does the controller fetch payloads (a copy through `ray.get`, the records stay offloaded).
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from molt.runtime.pool import Group


@lru_cache(maxsize=2)
def _tokenizer(model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def dump_groups(path: Path, groups: list[Group], model_path: str, advantages: dict[str, float] | None = None) -> None:
    """`advantages`: the per-rollout advantage of a group estimator (token-level estimators: omitted)."""
    import ray

    tok = _tokenizer(model_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for g in groups:
            for o in g.outcomes:
                for e in o.experiences:
                    payload = ray.get(e.payload_ref) if e.offloaded else {"token_ids": e.token_ids,
                        "action_mask": e.action_mask, "behavior_logprobs": e.behavior_logprobs, "versions": e.versions}
                    ids, mask = payload["token_ids"], payload["action_mask"]
                    f.write(json.dumps({
                        "group_id": g.group_id, "rollout_id": o.rollout_id, "segment": e.segment_index,
                        "break_reason": o.break_reasons[e.segment_index] if o.break_reasons else "start",
                        "reward": o.reward, "advantage": (advantages or {}).get(o.rollout_id),
                        "text": tok.decode(ids),
                        "action_text": tok.decode([t for t, m in zip(ids, mask) if m]),
                        "token_ids": ids, "action_mask": mask, "behavior_logprobs": payload["behavior_logprobs"],
                        "versions": payload["versions"],
                    }) + "\n")
