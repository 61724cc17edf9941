"""Window normalization: the token mean over the whole optimizer window (DESIGN.md, "Loss normalization").

The loss of one optimizer step is sum_{i in W} l_i / |W|, where W is every action token of every micro-batch
on every data-parallel rank of the step. The trainer
1. counts the action tokens of all its micro-batches (`count_action_tokens`),
2. all-reduces (SUM) that count over the data-parallel group once, before the first backward,
3. calls `window_normalize(loss, mask, global_count, dp_size=...)` on every micro-batch and backpropagates
   each result (gradients accumulate).
The result does not depend on how W is split. Rejected tokens (importance weight 0) keep their place in the
denominator because the count is taken from the action mask, not from the weights.

Decision: data-parallel wrappers (FSDP2, DDP) AVERAGE gradients over ranks; to make the step's gradient the
gradient of the window loss, the per-rank loss is scaled by `dp_size`. Pass dp_size=1 when gradients are
summed instead. A window without action tokens gives loss 0 and zero gradients (denominator at least 1).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from molt.algo.ops import as_mask, detach_all, masked_sum


def count_action_tokens(masks: Iterable[Tensor]) -> Tensor:
    """Number of action tokens over this rank's micro-batches' masks ([N_k, T_k] each); a 0-d int64 tensor
    to all-reduce with SUM (on the masks' device)."""
    counts = [as_mask(m).sum() for m in masks]
    return torch.stack(counts).sum() if counts else torch.zeros((), dtype=torch.int64)


def window_normalize(
    loss: Tensor, action_mask: Tensor, global_count: int | Tensor, *, dp_size: int = 1
) -> tuple[Tensor, dict]:
    """sum(loss * mask) * dp_size / max(global_count, 1): this micro-batch's share of the window loss.

    loss: [N, T] per-token contributions (importance weights already applied); action_mask: [N, T];
    global_count: action tokens in the whole window (all micro-batches, all ranks), an int or a 0-d tensor
    (kept on its device: no sync); dp_size: ranks whose gradients the wrapper averages.
    Returns (scalar loss, metrics {"loss/window_tokens", "loss/micro_tokens"})."""
    mask = as_mask(action_mask, loss)
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1 (got {dp_size})")
    if isinstance(global_count, int):
        if global_count < 0:
            raise ValueError(f"global_count must be >= 0 (got {global_count})")
        global_count = torch.tensor(global_count, device=loss.device)
    denom = global_count.to(device=loss.device, dtype=loss.dtype).clamp(min=1)
    out = masked_sum(loss, mask) * dp_size / denom
    return out, detach_all({"loss/window_tokens": global_count, "loss/micro_tokens": mask.sum()})
