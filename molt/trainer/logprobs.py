"""Log-probabilities and entropy of action tokens without materializing full-vocabulary logits.

The engine's behavior log-probability (see `molt.engine.base`) is

    logprob_t = log_softmax(logits_{t-1} / T)[token_t]      (T = 0 counts as 1)

where logits_{t-1} are the logits the model produced at position t-1 (the prediction of token t). The trainer
recomputes exactly this: the decoder backbone gives hidden states [B, L, H]; only the rows that predict an
action token are gathered ([A, H], A = number of action tokens), and the output projection, the division by
the temperature and an fp32 log-softmax run over chunks of `chunk_size` such rows, inside one autograd
Function that keeps only per-row results (log-prob, log-sum-exp, entropy) and recomputes each chunk's [c, V]
logits once in backward, forming their gradient in place: peak memory holds one chunk's logits (two [c, V]
buffers), never a micro-batch's.

Layout (same as `molt.algo`): outputs are [B, L], entry t is about token t, zero where `action_mask` is 0.
Position 0 has no prediction and must not be an action token.

Decisions:
- Prompt tokens never reach the output projection: in agentic contexts most tokens are context, so this
  saves most of the vocabulary projection as well as its memory.
- Families that post-process logits (Gemma-2 soft-capping, Cohere's logit scale) are refused at load time
  by `check_supported`, rather than silently computing a different distribution than the engine.
- Entropy (of the full distribution at the action position, after temperature) is optional: it costs a few
  elementwise passes over each chunk in forward; when it is only logged (not in the loss) its gradient is
  never formed (unmaterialized gradients), so its backward costs nothing.
- Compared with a full-logits log-softmax, the backward needs one more vocabulary matmul per chunk (the
  recompute); fusing the softmax gradient in place saves about as much elementwise work (bench/trainer.py).
- Shared prefixes (a `batching.SharedPrefix`): the decoder runs each distinct prefix once with a KV cache,
  the cache is gathered out to every row (an index_select, whose backward sums the rows' gradients into the
  one prefix pass), and the rest of each row runs against it. The cache goes through the model's own
  `DynamicCache`, so any Hugging Face decoder with a standard cache works; gradient checkpointing turns the
  cache off in training, so the trainer does not share prefixes then.
"""
from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn


def check_supported(config) -> None:
    """ValueError when the model's logits are not `lm_head(hidden)` (we would then differ from the engine)."""
    for name in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(config, name, None) not in (None, 1.0):
            raise ValueError(f"model config sets {name}={getattr(config, name)}; the chunked log-prob path "
                             "supports plain `lm_head(hidden)` logits only")


def _scaled_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, inv_temp: Tensor) -> Tensor:
    """[c, H] rows already divided by T -> [c, V] fp32 logits / T (a fresh tensor callers may modify in place).
    Dividing the [c, H] rows rather than the [c, V] logits saves a pass over the vocabulary."""
    z = nn.functional.linear(hidden, weight).float()
    return z if bias is None else z.add_(bias.float()[None] * inv_temp[:, None])


class _ChunkedLogProbs(torch.autograd.Function):
    """Forward: per chunk, logits -> log-sum-exp, target log-prob, entropy; only [A]-sized results are kept.
    Backward: per chunk, recompute the logits once and form the logit gradient in place,
        dL/dz = g_lp * (onehot(target) - p) - g_ent * p * (log p + H),
    then grad_hidden = dz @ W / T and grad_W += dz^T @ (hidden / T). One extra vocabulary matmul per chunk
    compared with keeping the logits, and at most two [c, V] buffers alive at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, inv_temp, chunk_size, with_entropy):
        n = hidden.shape[0]
        scaled = hidden * inv_temp[:, None].to(hidden.dtype)  # logits / T == (hidden / T) @ W^T
        lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse, ent = torch.empty_like(lp), torch.empty_like(lp)
        for s in range(0, n, chunk_size):
            sl = slice(s, s + chunk_size)
            z = _scaled_logits(scaled[sl], weight, bias, inv_temp[sl])
            lse[sl] = torch.logsumexp(z, -1)
            lp[sl] = z.gather(-1, targets[sl, None])[:, 0] - lse[sl]
            if with_entropy:  # H = lse - sum_k p_k z_k
                ent[sl] = lse[sl] - (z - lse[sl, None]).exp_().mul_(z).sum(-1)
        ctx.save_for_backward(scaled, weight, bias, targets, inv_temp, lse, ent)
        ctx.chunk_size, ctx.with_entropy = chunk_size, with_entropy
        ctx.set_materialize_grads(False)  # an unused output (entropy as a mere metric) then costs no backward work
        return lp, (ent if with_entropy else lp.new_empty(0))

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        scaled, weight, bias, targets, inv_temp, lse, ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(scaled) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        if g_lp is None:
            g_lp = torch.zeros_like(lse)
        use_ent = ctx.with_entropy and g_ent is not None
        for s in range(0, scaled.shape[0], ctx.chunk_size):
            sl = slice(s, s + ctx.chunk_size)
            logp = _scaled_logits(scaled[sl], weight, bias, inv_temp[sl]).sub_(lse[sl, None])
            gl = g_lp[sl, None]
            if use_ent:  # dz = -p * (g_lp + g_ent * (log p + H))
                p = logp.exp()
                dz = logp.add_(ent[sl, None]).mul_(g_ent[sl, None]).add_(gl).mul_(p).neg_()
                del p
            else:  # dz = -p * g_lp, in the same buffer
                dz = logp.exp_().mul_(-gl)
            dz = dz.scatter_add_(-1, targets[sl, None], gl).to(weight.dtype)
            if need_h:
                grad_h[sl] = dz @ weight
            if need_w:
                grad_w.addmm_(dz.T.float(), scaled[sl].float())
            if need_b:
                grad_b.addmv_(dz.T.float(), inv_temp[sl])
        if need_h:  # d(hidden / T)/d hidden = 1 / T
            grad_h.mul_(inv_temp[:, None].to(grad_h.dtype))
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(weight.dtype), None, None, None, None)


def gathered_logprobs(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: Tensor,
                      *, chunk_size: int = 512, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """Log-prob (and entropy) of `targets` [A] given the rows `hidden` [A, H] that predict them.

    temperature: [A] per-row temperature (0 means 1). Returns ([A] fp32, [A] fp32 or None)."""
    inv_temp = 1.0 / torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    lp, ent = _ChunkedLogProbs.apply(hidden, weight, bias, targets, inv_temp, chunk_size, with_entropy)
    return lp, (ent if with_entropy else None)


def action_logprobs(hidden: Tensor, weight: Tensor, bias: Tensor | None, input_ids: Tensor, action_mask: Tensor,
                    temperature: Tensor, *, chunk_size: int = 512,
                    with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs (and entropy) of the action tokens of a right-padded batch.

    hidden: [B, L, H] final hidden states; input_ids, action_mask: [B, L]; temperature: [B].
    Returns [B, L] fp32 tensors, zero where action_mask is 0."""
    mask = action_mask.bool()
    if mask[:, 0].any():
        raise ValueError("action_mask[:, 0] must be 0: the first token of a sequence has no prediction")
    # Row t-1 predicts token t: shift the mask left by one to pick the predicting rows.
    pred_mask = torch.zeros_like(mask)
    pred_mask[:, :-1] = mask[:, 1:]
    temp = temperature[:, None].expand_as(mask)
    lp, ent = gathered_logprobs(hidden[pred_mask], weight, bias, input_ids[mask], temp[mask],
                                chunk_size=chunk_size, with_entropy=with_entropy)

    def scatter(v: Tensor) -> Tensor:
        out = torch.zeros(mask.shape, dtype=torch.float32, device=hidden.device)
        return out.masked_scatter(mask, v)

    return scatter(lp), (scatter(ent) if ent is not None else None)


class CausalLMLogProbs(nn.Module):
    """Wraps a Hugging Face causal LM so that one `forward` (hence one FSDP root unshard) returns action-token
    log-probs instead of logits. `self.lm` keeps Hugging Face parameter names (`self.lm.state_dict()`)."""

    def __init__(self, lm: nn.Module, chunk_size: int = 512):
        super().__init__()
        check_supported(lm.config)
        self.lm = lm
        self.chunk_size = chunk_size
        # transformers 5.x renamed the decoder's `past_key_values` to `cache`; accept either
        params = inspect.signature(lm.get_decoder().forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def forward(self, input_ids: Tensor, attention_mask: Tensor, action_mask: Tensor, temperature: Tensor,
                with_entropy: bool = False, prefix=None) -> tuple[Tensor, Tensor | None]:
        decoder = self.lm.get_decoder()
        if prefix is None:
            hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        else:
            hidden = self._hidden_with_shared_prefix(decoder, input_ids, attention_mask, prefix)
        head = self.lm.get_output_embeddings()
        return action_logprobs(hidden, head.weight, head.bias, input_ids, action_mask, temperature,
                               chunk_size=self.chunk_size, with_entropy=with_entropy)

    def _hidden_with_shared_prefix(self, decoder: nn.Module, input_ids: Tensor, attention_mask: Tensor,
                                   prefix) -> Tensor:
        """[B, L, H] hidden states, zero over the first `prefix.length` positions (they predict no action)."""
        from transformers import DynamicCache

        p = prefix.length
        cache = DynamicCache(config=self.lm.config)
        kw = self._cache_kw
        decoder(input_ids=input_ids[prefix.rows, :p], use_cache=True, **{kw: cache})
        if cache.get_seq_length() != p:
            raise ValueError(f"{type(decoder).__name__} did not fill its KV cache; set --train.share_prefix false")
        cache.batch_select_indices(prefix.index)
        rest = decoder(input_ids=input_ids[:, p:], attention_mask=attention_mask, use_cache=True, **{kw: cache})
        hidden = rest.last_hidden_state
        return torch.cat([hidden.new_zeros(hidden.shape[0], p, hidden.shape[2]), hidden], dim=1)
