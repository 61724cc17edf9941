"""Window normalization: the token mean over the whole optimizer window (DESIGN.md, "Loss normalization").

Design notes and decisions: docs/internals.md, section `molt/algo/normalize.py`.
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
