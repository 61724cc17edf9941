"""Human-readable trajectory dumps (`--train.dump_trajectories_steps`): one JSON line per segment, which
`molt inspect` reads. Only on dump steps does the controller fetch payloads (a copy through `ray.get`).
Fields for the inspector (older dumps lack them): `pieces`, each token's text (`_pieces`; they join to `text`);
`trainer_logprobs` under the policy before the step's update (the proximal policy the importance gate compares
with; one extra no-grad pass, on dump steps only); `is_weights`, each token's importance weight with the run's
`algo.advantage.is_correction_*`, one segment per sequence as in training (0: rejected by the gate).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from molt.runtime.pool import Group
from molt.types import PAYLOAD_FIELDS, token_lists


@lru_cache(maxsize=2)
def _tokenizer(model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _pieces(tok, ids: list[int]) -> list[str]:
    """Per-token text. A token decoded alone loses context (SentencePiece's leading space, the bytes of a
    character split over tokens), so each token's text is what it adds to a window that starts at the previous
    emitted token; a token that leaves an incomplete character (U+FFFD) waits, and the token that completes it
    carries the whole character."""
    out, prefix, read = [], 0, 0
    for i in range(len(ids)):
        before, after = tok.decode(ids[prefix:read]), tok.decode(ids[prefix : i + 1])
        done = len(after) > len(before) and not after.endswith("\ufffd")
        out.append(after[len(before) :] if done else "")
        prefix, read = (read, i + 1) if done else (prefix, read)
    if read < len(ids):  # trailing bytes that never formed a character
        out[-1] += tok.decode(ids[prefix:])[len(tok.decode(ids[prefix:read])) :]
    return out


def _advantage(e: Any, advantages: dict) -> Any:
    if e.credit in advantages or not e.turns:
        return advantages.get(e.credit)
    return [advantages.get(key) for key in e.turn_credits]


def dump_groups(
    path: Path,
    groups: list[Group],
    model_path: str,
    advantages: dict[str, float] | None = None,
    trainer_logprobs: dict[tuple[str, int], Any] | None = None,
    gate: tuple = ("off",),
) -> None:
    """`advantages`: a group estimator's per rollout and role, or per turn (a list in the turns' order; token-level
    estimators: omitted);
    `trainer_logprobs` by (rollout id, segment index); `gate`: (level, mode, low, high) of the importance gate."""
    import ray
    import torch

    from molt.algo import importance_weights

    tok = _tokenizer(model_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for g in groups:
            for o in g.outcomes:
                for e in o.experiences:
                    p = ray.get(e.payload_ref) if e.offloaded else {k: getattr(e, k) for k in PAYLOAD_FIELDS}
                    lists = token_lists(
                        p["token_ids"], p["action_mask"], p["behavior_logprobs"], p["versions"]
                    )
                    ids, mask = lists["token_ids"], lists["action_mask"]
                    line = {
                        "group_id": g.group_id,
                        "rollout_id": o.rollout_id,
                        "segment": e.segment_index,
                        "break_reason": o.break_reasons[e.segment_index] if o.break_reasons else "start",
                        "role": e.role,
                        "reward": o.reward_of(e.role),
                        "advantage": _advantage(e, advantages or {}),
                        "text": tok.decode(ids),
                        "pieces": _pieces(tok, ids),
                        "action_text": tok.decode([t for t, m in zip(ids, mask) if m]),
                        **lists,
                    }
                    lp = (trainer_logprobs or {}).get((o.rollout_id, e.segment_index))
                    if lp is not None:
                        line["trainer_logprobs"] = lp = [float(x) for x in lp]
                        w, _ = importance_weights(
                            *(
                                torch.tensor([x], dtype=torch.float64)
                                for x in (lp, lists["behavior_logprobs"], mask)
                            ),
                            *gate,
                        )
                        line["is_weights"] = w[0].tolist()
                    f.write(json.dumps(line) + "\n")
