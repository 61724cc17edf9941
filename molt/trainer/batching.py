"""Micro-batches of one optimizer window: planning by token budget or count, and padded or packed collation.

Decisions:
- Pad or pack (`pack=True`, `--fsdp.packing_samples`). Padded: each micro-batch is a right-padded [B, L] batch
  (given to the decoder without an attention mask, below). Packed: the micro-batch is ONE row [1, T] of its
  sequences back to back, positions restarting at 0 for each, no padding at all; the decoder attends within
  each sequence through `molt.trainer.packing` (varlen flash attention on CUDA, one causal SDPA call per
  sequence on CPU), and `seq_ids` [1, T] names each token's sequence for the sequence-level rules of
  `molt.algo`. Both give the same log-probs and gradients (tests/trainer/test_packing.py). Packing saves the
  padding and batches sequences of any mix of lengths at full width. With prefix sharing a packed row holds
  each shared prefix once, followed by the rest of every sequence that starts with it (`_pack`): one decoder
  call as always, so it works on any number of ranks and with gradient checkpointing, unlike the padded
  KV-cache path below.
- Padded rows get no attention mask (`MicroBatch.decoder_inputs`; `attention_mask` stays on the micro-batch for
  what reads it: the MoE load-balancing loss weighs padded tokens 0, Qwen2-VL's M-RoPE positions). Rows are
  right-padded, so whatever a real token may attend to under the model's own mask (earlier tokens, a sliding
  window of them, the rest of its image's block, a shared prefix's cached keys) is real: the padding mask
  changes nothing at real positions, positions stay 0..L-1 as it would leave them, and nothing reads the padded
  positions' outputs (`act_index`), so their gradient is 0. No [B, 1, L, L] mask then (8.1 GB at the
  65,536-token budget before): SDPA runs causal without one (`molt.trainer.packing`, which also spares the host
  sync transformers' "sdpa" would spend looking for packed positions); sliding-window layers keep "sdpa",
  whose window mask transformers builds from positions alone. Tested against each sequence alone
  (tests/trainer/test_padded_rows.py: dense, shared prefix, MoE, sliding window, LLaVA and Qwen2-VL with
  images, the critic's values, the MoE aux loss). Left padding would need the mask.
- Everything the step indexes with is built here, on the host, from the experiences' numpy arrays (padded or
  packed in numpy, then one `torch.from_numpy` per field): the flat positions of the action tokens
  (`act_index`), their temperatures, the action count. Per-action values (behavior log-probs) and a rollout's
  one advantage are laid out per token here. The step then gathers and scatters with
  index tensors and never asks the device for a value (no boolean-mask indexing, whose backward calls
  `nonzero` and synchronizes).
- Experiences are sorted by length (longest first) before planning, so rows of similar length share a
  micro-batch and padding stays small. The loss does not depend on the split (window normalization).
- `max_tokens_per_gpu` budgets the tokens the decoder runs: padded tokens (B * L) when padding, real tokens
  when packing (first-fit decreasing); a sequence longer than the budget gets a micro-batch of its own rather
  than failing.
- Shared prefixes (`share_prefix=True`): the rows of a prompt group start with the same context tokens. Collate
  finds the longest length p such that every row still has an action-free stretch of p tokens plus one (the
  last context token's hidden state predicts the first action), and, when some rows share their first p
  tokens, records one representative row per distinct prefix: the model then runs each distinct prefix once
  and the rest of every row against its cached keys and values (`molt.trainer.logprobs`). Exact (same
  log-probs and gradients up to float rounding); with 8 samples per prompt and a prompt about as long as the
  reply it removes close to half of the decoder's tokens.
- Images: the experiences' processor inputs join `MicroBatch.images` in row order (the order the model fills
  placeholder tokens in); such rows share no prefix (all images' placeholders are the same tokens) and are not
  packed yet (the packed attention arguments would reach the vision tower): a ValueError.
- FSDP2 over several ranks shards the vision tower's blocks too, so every rank must run them the same number of
  times: a VLM's micro-batch without images (a text row, a ghost) there carries `blank_image`, whose features
  the forward adds to the input embeddings times 0. Every micro-batch then runs the vision tower once (a
  micro-batch's images go through it in one call), in the same place of the forward and of the backward (the
  features meet the embeddings in both cases), and every vision parameter gets a gradient (0), as FSDP2's
  reduce-scatters need. A single process skips it (nothing to match).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor

from molt.types import Experience, expand_actions, join_inputs


def plan_micro_batches(
    lengths: list[int],
    micro_batch_size: int | None = None,
    max_tokens_per_gpu: int | None = None,
    packed: bool = False,
) -> list[list[int]]:
    """Indices into `lengths`, grouped into micro-batches (each non-empty, together a permutation)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if max_tokens_per_gpu is not None and packed:  # first-fit decreasing on real tokens
        bins: list[list[int]] = []
        room: list[int] = []
        for i in order:
            k = next((b for b, r in enumerate(room) if lengths[i] <= r), len(bins))
            if k == len(bins):
                bins.append([])
                room.append(max_tokens_per_gpu)
            bins[k].append(i)
            room[k] -= lengths[i]
        return bins
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
    return [order[s : s + size] for s in range(0, len(order), size)]


@dataclass
class SharedPrefix:
    """Rows of a micro-batch that begin with the same `length` tokens: `rows` [U] holds one representative row
    per distinct prefix, `index` [B] the position in `rows` of each row's prefix."""

    length: int
    rows: Tensor
    index: Tensor


def shared_prefix(token_ids: list, action_masks: list) -> SharedPrefix | None:
    """The prefix to compute once per distinct value, or None when no two rows share one (or a row has fewer
    than two tokens before its first action). Rows: arrays (or lists) of ids and of 0/1."""
    if len(token_ids) < 2:
        return None
    masks = [np.asarray(m, bool) for m in action_masks]
    firsts = [int(m.argmax()) if m.any() else len(m) for m in masks]
    length = min(firsts) - 1  # the hidden state at first-action - 1 must come from the per-row pass
    if length < 1:
        return None
    owner: dict[bytes, int] = {}
    index = [owner.setdefault(np.asarray(ids[:length], np.int64).tobytes(), len(owner)) for ids in token_ids]
    if len(owner) == len(token_ids):
        return None
    rows = [index.index(u) for u in range(len(owner))]  # the first row with each prefix
    return SharedPrefix(length, torch.tensor(rows), torch.tensor(index))


@dataclass
class MicroBatch:
    """Tensors of one forward/backward pass, on the device. [R, L] is [B, L] padded or [1, T] packed."""

    input_ids: Tensor  # [R, L] int64, right-padded with pad_id (padded layout)
    attention_mask: Tensor | None  # [R, L] int64, 1 on real tokens (not for the decoder); None when packed
    action_mask: Tensor  # [R, L] bool, 1 on tokens the policy sampled
    behavior_logprobs: Tensor  # [R, L] fp32, 0 off action tokens
    advantages: Tensor  # [R, L] fp32
    act_index: Tensor  # [A] int64 flat positions (into R * L) of the action tokens
    act_temperature: Tensor  # [A] fp32 sampling temperature of each action token
    num_actions: int  # A, known on the host (0 for a ghost)
    # per experience (row, start, length, skip): its tokens from `skip` on lie at row[start : start + length -
    # skip]; the first `skip` are a prefix shared with other rows
    spans: list[tuple[int, int, int, int]]
    extra: dict[str, Tensor] | None = None  # more [R, L] fp32 per-token inputs (old_logprobs, returns, ...)
    ghost: bool = False  # a stand-in that keeps collectives in step; its loss is multiplied by 0
    prefix: SharedPrefix | None = None  # rows that share their first tokens (share_prefix=True)
    seq_ids: Tensor | None = None  # [1, T] int64 sequence index of each token (packed)
    packing: dict | None = None  # packed: position_ids and the attention's arguments (`_pack`)
    # [R, L, layers, k] int64 experts the engine routed to (`Segment.routed_experts`)
    routes: Tensor | None = None
    images: dict | None = None  # processor inputs of the rows' images in row order (module docstring)
    blank: dict | None = None  # a VLM's micro-batch without images on several ranks: `blank_image`'s inputs

    def decoder_inputs(self) -> dict:
        """Keyword arguments of a Hugging Face decoder's forward: packed, the attention's arguments; padded, no
        attention mask (module docstring: right padding changes nothing a real token attends to)."""
        return {"input_ids": self.input_ids, **(self.packing or {})}


def pad_rows(rows: list, value, dtype: type, length: int) -> Tensor:
    # rows: per-token arrays (routes: [n, layers, k]); right-padded to [B, length, ...] in one new array (the
    # rows may be read-only views of the object store)
    out = np.full((len(rows), length, *np.shape(rows[0])[1:]), value, dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return torch.from_numpy(out)


def _cat(rows: list, dtype: type) -> Tensor:
    return torch.from_numpy(np.concatenate([np.asarray(r, dtype) for r in rows])[None])


def collate(
    exps: list[Experience],
    pad_id: int,
    device: torch.device,
    *,
    extra: dict[str, list] | None = None,
    need_advantages: bool = True,
    share_prefix: bool = False,
    pack: bool = False,
) -> MicroBatch:
    """Pad (or `pack`) a list of (reloaded) experiences into a MicroBatch on `device`; `extra` holds more
    per-token arrays (or lists) aligned with `exps` (laid out the same way); `share_prefix` looks for rows with a common
    prefix (padded: `mb.prefix` for the KV-cache path; packed: the prefix is laid out once, see `_pack`)."""
    for e in exps:
        if e.token_ids is None:
            raise ValueError(f"experience {e.rollout_id}/{e.segment_index} is offloaded: reload() it first")
        if need_advantages and e.advantages is None:
            raise ValueError(f"experience {e.rollout_id}/{e.segment_index} has no advantages")
        if len(e.action_mask) and e.action_mask[0]:
            raise ValueError("action_mask[0] must be 0: the first token of a sequence has no prediction")
    images = join_inputs(*(e.images for e in exps))
    if images and pack:
        raise ValueError(
            "packing_samples: experiences with images cannot be packed yet; set --fsdp.packing_samples false"
        )
    lens = [len(e.token_ids) for e in exps]
    for k, v in (extra or {}).items():  # a short list would shift every later sequence of a packed row
        if [len(row) for row in v] != lens:
            raise ValueError(f"{k}: per-token lists must be as long as the experiences' token_ids")
    behavior = [expand_actions(e.behavior_logprobs, e.action_mask, 0.0) for e in exps]
    per_token = {
        "input_ids": ([e.token_ids for e in exps], pad_id, np.int64),
        "action_mask": ([e.action_mask for e in exps], False, bool),
        "behavior_logprobs": (behavior, 0.0, np.float32),
        # a rollout's advantage (a number) or one per token, 0 off action tokens either way
        "advantages": (
            [np.where(e.action_mask, 0.0 if e.advantages is None else e.advantages, 0.0) for e in exps],
            0.0,
            np.float32,
        ),
        "temperature": ([np.full(n, e.temperature) for e, n in zip(exps, lens)], 1.0, np.float32),
        **{k: (v, 0.0, np.float32) for k, v in (extra or {}).items()},
    }
    if exps and all(e.routed_experts is not None for e in exps):
        per_token["routes"] = ([e.routed_experts for e in exps], 0, np.int64)
    if pack:
        t, spans, packing = _pack(per_token, exps, share_prefix)
    else:
        length = max(lens)
        t = {k: pad_rows(rows, value, dtype, length) for k, (rows, value, dtype) in per_token.items()}
        t["attention_mask"] = pad_rows([np.ones(n, np.int64) for n in lens], 0, np.int64, length)
        spans = [(i, 0, n, 0) for i, n in enumerate(lens)]
    ghost = not t["action_mask"].numpy().any()  # numpy: its any and flatnonzero are much cheaper on the host
    if ghost and t["action_mask"].shape[1] < 2:
        return ghost_batch(pad_id, device, extra or {}, pack)
    if ghost:
        # mark one token as an action so that every parameter (the output head included) joins the backward, as
        # FSDP2 expects the same parameters to receive gradients on every rank; the loss is zeroed
        t["action_mask"][0, 1] = True
    act_index = torch.from_numpy(np.flatnonzero(t["action_mask"].numpy()))  # host arrays: no device sync
    mb = MicroBatch(
        t["input_ids"],
        t.get("attention_mask"),
        t["action_mask"],
        t["behavior_logprobs"],
        t["advantages"],
        act_index,
        t["temperature"].flatten()[act_index],
        0 if ghost else len(act_index),
        spans,
        extra={k: t[k] for k in extra or {}},
        ghost=ghost,
        routes=t.get("routes"),
        images=images,
    )
    if pack:
        mb.seq_ids, mb.packing = t["seq_ids"], packing
    elif share_prefix and not ghost and mb.routes is None and not images:  # routes need one decoder call
        mb.prefix = shared_prefix([e.token_ids for e in exps], [e.action_mask for e in exps])
    return to_device(mb, device)


def _pack(per_token: dict, exps: list[Experience], share_prefix: bool) -> tuple[dict, list, dict]:
    """One row of pieces: each experience whole, or (`share_prefix`, a prompt group) each distinct shared
    prefix once followed by the rest of every row that starts with it. Returns the row's tensors, the spans
    and the attention's keyword arguments (`molt.trainer.packing`): piece bounds, and for every piece the
    range of keys it attends to besides itself (its prefix piece), as ranges and as a key index."""
    lens = [len(e.token_ids) for e in exps]
    prefix = (
        shared_prefix([e.token_ids for e in exps], [e.action_mask for e in exps]) if share_prefix else None
    )
    pieces: list[tuple[int, int, int, int | None]] = []  # (experience, first token, end, prefix piece)
    if prefix is None:
        pieces = [(i, 0, n, None) for i, n in enumerate(lens)]
    else:
        owners = prefix.index.tolist()
        for u, rep in enumerate(prefix.rows.tolist()):
            head = len(pieces)
            pieces.append((rep, 0, prefix.length, None))
            pieces += [(i, prefix.length, lens[i], head) for i, owner in enumerate(owners) if owner == u]
    sizes = [hi - lo for _, lo, hi, _ in pieces]
    bounds = list(itertools.accumulate(sizes, initial=0))
    t = {
        k: _cat([rows[i][lo:hi] for i, lo, hi, _ in pieces], dtype)
        for k, (rows, _, dtype) in per_token.items()
    }
    t["seq_ids"] = _cat([np.full(hi - lo, i) for i, lo, hi, _ in pieces], np.int64)
    t["position_ids"] = _cat([np.arange(lo, hi) for _, lo, hi, _ in pieces], np.int64)
    spans = [None] * len(exps)
    for k, (i, lo, _, head) in enumerate(pieces):
        if head is not None or prefix is None:  # not a prefix piece
            spans[i] = (0, bounds[k], lens[i], lo)
    heads = [None if h is None else (bounds[h], bounds[h + 1]) for *_, h in pieces]
    # each piece attends to its prefix piece's keys (if any), then its own
    kv = [np.r_[np.arange(*h or (0, 0)), a:b] for h, (a, b) in zip(heads, itertools.pairwise(bounds))]
    packing = {
        "position_ids": t["position_ids"],
        "molt_bounds": bounds,
        "molt_prefixes": heads,
        "cu_seq_lens_q": torch.tensor(bounds, dtype=torch.int32),
        "max_length_q": max(sizes),
        "cu_seq_lens_k": torch.tensor(list(itertools.accumulate(map(len, kv), initial=0)), dtype=torch.int32),
        "max_length_k": max(map(len, kv)),
    }
    if prefix is not None:
        packing["molt_kv_index"] = torch.from_numpy(np.concatenate(kv))
    return t, spans, packing


def ghost_batch(pad_id: int, device: torch.device, extra_keys=(), pack: bool = False) -> MicroBatch:
    """A two-token micro-batch for a rank that has run out of work while others still have micro-batches."""
    e = Experience(
        rollout_id="ghost",
        group_id="ghost",
        segment_index=0,
        reward=0.0,
        num_tokens=2,
        num_actions=0,
        min_version=0,
        temperature=1.0,
        token_ids=[pad_id, pad_id],
        action_mask=[0, 0],
        behavior_logprobs=[],
        versions=[],
        advantages=0.0,
    )
    return collate([e], pad_id, device, extra={k: [[0.0, 0.0]] for k in extra_keys}, pack=pack)


def blank_image(path: str, device: torch.device) -> dict:
    """The checkpoint's own image-processor inputs of one blank image, on `device`."""
    from PIL import Image
    from transformers import AutoImageProcessor

    inputs = AutoImageProcessor.from_pretrained(path)(
        images=[Image.new("RGB", (64, 64))], return_tensors="pt"
    )
    return {k: v.to(device) for k, v in inputs.items()}


def to_device(mb: MicroBatch, device: torch.device) -> MicroBatch:
    """Copy the tensors over (pinned and asynchronous on CUDA: the host does not wait for the copies)."""

    def move(x):
        if not isinstance(x, Tensor):
            return x
        return (x.pin_memory() if device.type == "cuda" else x).to(device, non_blocking=True)

    for f in fields(mb):  # the [R, L] and [A] tensors
        setattr(mb, f.name, move(getattr(mb, f.name)))
    mb.extra = {k: move(v) for k, v in (mb.extra or {}).items()}
    mb.images = mb.images and {k: move(v) for k, v in mb.images.items()}
    if mb.packing is not None:
        mb.packing = {k: move(v) for k, v in mb.packing.items()}
    if mb.prefix is not None:
        mb.prefix = SharedPrefix(mb.prefix.length, move(mb.prefix.rows), move(mb.prefix.index))
    return mb
