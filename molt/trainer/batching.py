"""Micro-batches of one optimizer window: planning by token budget or count, and right-padded collation.

Decisions:
- Pad, don't pack. Each micro-batch is a right-padded [B, L] batch with an attention mask, the layout of
  `molt.algo` (entry t is about token t). Padding is exact with every attention implementation and costs
  attention work only over each row; packing many sequences into one row saves the padding but, on CPU
  with SDPA, pays dense [L, L] attention over the packed row. Packing (varlen flash attention) is a GPU-path
  option for later.
- Experiences are sorted by length (longest first) before planning, so rows of similar length share a
  micro-batch and padding stays small. The loss does not depend on the split (window normalization).
- `max_tokens_per_gpu` budgets *padded* tokens (B * L) because that is what activations cost; a sequence
  longer than the budget gets a micro-batch of its own rather than failing.
- Shared prefixes (`share_prefix=True`): the rows of a prompt group start with the same context tokens. Collate
  finds the longest length p such that every row still has an action-free stretch of p tokens plus one (the
  last context token's hidden state predicts the first action), and, when some rows share their first p
  tokens, records one representative row per distinct prefix: the model then runs each distinct prefix once
  and the rest of every row against its cached keys and values (`molt.trainer.logprobs`). Exact (same
  log-probs and gradients up to float rounding); with 8 samples per prompt and a prompt about as long as the
  reply it removes close to half of the decoder's tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from molt.types import Experience


def plan_micro_batches(lengths: list[int], micro_batch_size: int | None = None,
                       max_tokens_per_gpu: int | None = None) -> list[list[int]]:
    """Indices into `lengths`, grouped into micro-batches (each non-empty, together a permutation)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if max_tokens_per_gpu is not None:
        batches: list[list[int]] = []
        for i in order:
            # sorted longest first, so the batch's padded length is its first member's length
            if batches and lengths[batches[-1][0]] * (len(batches[-1]) + 1) <= max_tokens_per_gpu:
                batches[-1].append(i)
            else:
                batches.append([i])
        return batches
    size = micro_batch_size or max(len(order), 1)
    return [order[s:s + size] for s in range(0, len(order), size)]


@dataclass
class SharedPrefix:
    """Rows of a micro-batch that begin with the same `length` tokens: `rows` [U] holds one representative row
    per distinct prefix, `index` [B] the position in `rows` of each row's prefix."""
    length: int
    rows: Tensor
    index: Tensor


def shared_prefix(token_ids: list[list[int]], action_masks: list[list[int]]) -> SharedPrefix | None:
    """The prefix to compute once per distinct value, or None when no two rows share one (or a row has fewer
    than two tokens before its first action)."""
    if len(token_ids) < 2:
        return None
    firsts = [next((t for t, a in enumerate(mask) if a), len(mask)) for mask in action_masks]
    length = min(firsts) - 1  # the hidden state at first-action - 1 must come from the per-row pass
    if length < 1:
        return None
    owner: dict[tuple[int, ...], int] = {}
    index = [owner.setdefault(tuple(ids[:length]), len(owner)) for ids in token_ids]
    if len(owner) == len(token_ids):
        return None
    rows = [index.index(u) for u in range(len(owner))]  # the first row with each prefix
    return SharedPrefix(length, torch.tensor(rows), torch.tensor(index))


@dataclass
class MicroBatch:
    input_ids: Tensor  # [B, L] int64, right-padded with pad_id
    attention_mask: Tensor  # [B, L] int64, 1 on real tokens
    action_mask: Tensor  # [B, L] bool, 1 on tokens the policy sampled
    behavior_logprobs: Tensor  # [B, L] fp32, 0 off action tokens
    advantages: Tensor  # [B, L] fp32
    temperature: Tensor  # [B] fp32 sampling temperature of each row
    extra: dict[str, Tensor] | None = None  # more [B, L] fp32 per-token inputs (old_logprobs, returns, ...)
    ghost: bool = False  # a stand-in that keeps collectives in step; its loss is multiplied by 0
    prefix: SharedPrefix | None = None  # rows that share their first tokens (share_prefix=True)

    @property
    def num_actions(self) -> int:
        return 0 if self.ghost else int(self.action_mask.sum())


def _pad(rows: list[list], value, dtype: torch.dtype, length: int) -> Tensor:
    return torch.tensor([list(r) + [value] * (length - len(r)) for r in rows], dtype=dtype)


def collate(exps: list[Experience], pad_id: int, device: torch.device, *,
            extra: dict[str, list[list[float]]] | None = None, need_advantages: bool = True,
            share_prefix: bool = False) -> MicroBatch:
    """Right-pad a list of (reloaded) experiences into a MicroBatch on `device`; `extra` holds more per-token
    lists aligned with `exps` (padded the same way); `share_prefix` looks for rows with a common prefix."""
    for e in exps:
        if e.token_ids is None:
            raise ValueError(f"experience {e.rollout_id}/{e.segment_index} is offloaded: reload() it first")
        if need_advantages and e.advantages is None:
            raise ValueError(f"experience {e.rollout_id}/{e.segment_index} has no advantages")
    length = max(len(e.token_ids) for e in exps)
    mb = MicroBatch(
        input_ids=_pad([e.token_ids for e in exps], pad_id, torch.long, length),
        attention_mask=_pad([[1] * len(e.token_ids) for e in exps], 0, torch.long, length),
        action_mask=_pad([e.action_mask for e in exps], 0, torch.bool, length),
        behavior_logprobs=_pad([e.behavior_logprobs for e in exps], 0.0, torch.float32, length),
        advantages=_pad([e.advantages or [0.0] * len(e.token_ids) for e in exps], 0.0, torch.float32, length),
        temperature=torch.tensor([e.temperature for e in exps], dtype=torch.float32),
        extra={k: _pad(v, 0.0, torch.float32, length) for k, v in (extra or {}).items()},
    )
    if not mb.action_mask.any():
        return to_device(ghost_batch(pad_id, device) if length < 2 else _ghostify(mb), device)
    if share_prefix:
        mb.prefix = shared_prefix([e.token_ids for e in exps], [e.action_mask for e in exps])
    return to_device(mb, device)


def _ghostify(mb: MicroBatch) -> MicroBatch:
    """Mark one token as an action so that every parameter (the output head included) joins the backward,
    as FSDP2 expects the same parameters to receive gradients on every rank; the loss is then zeroed."""
    mb.action_mask[0, 1] = True
    mb.ghost = True
    return mb


def ghost_batch(pad_id: int, device: torch.device, extra_keys=()) -> MicroBatch:
    """A two-token micro-batch for a rank that has run out of work while others still have micro-batches."""
    z = torch.zeros(1, 2)
    extra = {k: z.clone() for k in extra_keys}
    mb = MicroBatch(torch.full((1, 2), pad_id, dtype=torch.long), torch.ones(1, 2, dtype=torch.long),
                    torch.zeros(1, 2, dtype=torch.bool), z.clone(), z.clone(), torch.ones(1), extra=extra)
    return to_device(_ghostify(mb), device)


def to_device(mb: MicroBatch, device: torch.device) -> MicroBatch:
    for name in ("input_ids", "attention_mask", "action_mask", "behavior_logprobs", "advantages", "temperature"):
        setattr(mb, name, getattr(mb, name).to(device, non_blocking=True))
    mb.extra = {k: v.to(device, non_blocking=True) for k, v in (mb.extra or {}).items()}
    if mb.prefix is not None:
        mb.prefix = SharedPrefix(mb.prefix.length, mb.prefix.rows.to(device), mb.prefix.index.to(device))
    return mb
