"""Per-row sampling for the embedded engine (`molt.engine.hf`): each row is a request with its own temperature,
top-k, top-p, min_tokens and random generator.

Behavior log-probability: exactly `molt.engine.base`'s definition, log_softmax(logits / T) over the full
vocabulary (T = 0 -> 1), before top-k/top-p and before the min_tokens suppression of stop tokens (that
suppression is a truncation like top-k: the token is sampled from the masked distribution, the record is the
unmasked one); a row whose grammar allows only stop tokens keeps them (vLLM 0.32's `MinTokensLogitsProcessor`
restores them the same way), so `min_tokens` holds while the grammar allows anything else. A constrained
request's grammar (`SamplingParams.grammar`, an llguidance matcher) is different: the tokens it disallows are
removed from the logits first, so its record (and `top_logprobs`) is of the masked distribution. vLLM does the
same and can do nothing else: it applies the grammar's bitmask to the logits before its sampler, so every
`logprobs_mode` it has is masked (vLLM 0.32 `gpu_model_runner.py`, `apply_grammar_bitmask`). It is also how the
token was really sampled; the trainer, which knows no grammar, recomputes the full distribution, so rho of a
constrained token is below 1 by the mass the grammar removed (docs/algo.md).

Sampling draws from a per-request `random.Random` (seeded by `SamplingParams.seed`): one uniform number per token,
mapped through the float64 CDF of the (truncated) distribution. A seeded request therefore reproduces no matter
which other requests share its batch (up to float differences of the batched matmuls).
"""

from __future__ import annotations

from typing import Any

import torch
from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

NEG_INF = -float("inf")


def sample(logits: torch.Tensor, reqs: list[Any]) -> tuple[list[int], list[float], list[list]]:
    """Per-row sampling of logits [rows, vocab]; a row (the engine's request) has `params`, `tokens` (sampled so
    far), `stops`, `generator` and `matcher` (its grammar's, or None). Returns token ids, their behavior log-probs
    (module docstring), top alternatives."""
    vocab, device = logits.shape[1], logits.device
    constrained = [i for i, r in enumerate(reqs) if r.matcher is not None]
    # only the rows with a grammar pay: llguidance's bitmask (a bit per token) of each, unpacked
    if constrained:
        bits = allocate_token_bitmask(len(constrained), vocab)
        for row, i in enumerate(constrained):
            fill_next_token_bitmask(reqs[i].matcher, bits, row)
        # unpacked here rather than by llguidance.torch.apply_token_bitmask_inplace, which is torch.compile'd
        # (a compile, and a C++ toolchain on a CPU, at the first constrained request)
        shifts = torch.arange(32, dtype=torch.int32)
        allowed = (bits[:, :, None] >> shifts & 1).view(len(bits), -1)[:, :vocab]
        rows = torch.tensor(constrained, device=device)
        masked = logits[rows].masked_fill(allowed.to(device) == 0, NEG_INF)
        logits = logits.index_put((rows,), masked)
    temps = torch.tensor([r.params.temperature or 1.0 for r in reqs], device=device)
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    scores = logp
    suppress = [(i, r.stops) for i, r in enumerate(reqs) if len(r.tokens) < r.params.min_tokens and r.stops]
    if suppress:  # one indexed write for all rows (a write per row was 256 launches a step on a GPU)
        rows = torch.tensor([i for i, stops in suppress for _ in stops], device=device)
        columns = torch.tensor([s for _, stops in suppress for s in stops], device=device)
        scores = logp.clone()
        scores[rows, columns] = NEG_INF
        # a grammar that allows only stop tokens (a finished one) lets them through, as vLLM's min-tokens processor
        scores = torch.where(scores.isneginf().all(-1, keepdim=True), logp, scores)
    if any(r.params.top_k > 0 or r.params.top_p < 1.0 for r in reqs):
        scores = _truncate(scores, [r.params.top_k for r in reqs], [r.params.top_p for r in reqs])
    # Inverse-CDF sampling with one uniform draw per row from the request's own generator: exact, and a
    # handful of batched ops instead of a vocabulary-sized noise draw per row (which dominated a step on 2 cores).
    cdf = scores.softmax(-1).double().cumsum(-1)
    # Python's generators: 256 draws take 0.02 ms of host time; a torch.rand per row took 1.4 ms (cProfile)
    uniform = torch.tensor([r.generator.random() for r in reqs], dtype=torch.float64, device=device)
    picked = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)[:, 0].clamp(max=vocab - 1)
    greedy = [r.params.temperature == 0 for r in reqs]
    if any(greedy):
        picked = torch.where(torch.tensor(greedy, device=device), scores.argmax(-1), picked)
    chosen = logp.gather(1, picked[:, None])[:, 0]
    n_top = max(r.params.top_logprobs for r in reqs)
    tops: list[list] = [[] for _ in reqs]
    if n_top:
        values, indices = logp.topk(n_top, dim=-1)
        # a grammar may allow fewer than asked
        tops = [
            [(t, lp) for t, lp in zip(i, v) if lp > NEG_INF]
            for i, v in zip(indices.tolist(), values.tolist())
        ]
    return picked.tolist(), chosen.tolist(), tops


def _truncate(scores: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Top-k then top-p (on the renormalized top-k distribution), per row; removed entries become -inf."""
    vocab = scores.shape[1]
    ks = torch.tensor([k if k > 0 else vocab for k in top_k], device=scores.device)
    ps = torch.tensor([p if p < 1.0 else torch.inf for p in top_p], device=scores.device, dtype=scores.dtype)
    ordered, order = scores.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=scores.device)
    ordered = ordered.masked_fill(ranks[None] >= ks[:, None], NEG_INF)
    probs = ordered.softmax(-1)
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    ordered = ordered.masked_fill(probs.cumsum(-1) - probs >= ps[:, None], NEG_INF)
    return torch.full_like(scores, NEG_INF).scatter(1, order, ordered)
