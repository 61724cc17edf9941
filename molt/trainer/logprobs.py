"""Log-probabilities and entropy of action tokens without materializing full-vocabulary logits.

Design notes and decisions: docs/internals.md, section `molt/trainer/logprobs.py`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from molt.modeling import ModelSpec, mm_f32, rope_positions


def check_supported(config) -> None:
    """ValueError when the model's logits are not `lm_head(hidden)` (we would then differ from the engine)."""
    for name in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(config, name, None) not in (None, 1.0):
            raise ValueError(
                f"model config sets {name}={getattr(config, name)}; the chunked log-prob path "
                "supports plain `lm_head(hidden)` logits only"
            )


def compute_dtype(t: Tensor) -> torch.dtype:
    """The dtype matmuls of `t`'s device run in here: autocast's when it is on, else the tensor's own."""
    dev = t.device.type
    on = torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev)  # (meta has no autocast)
    return torch.get_autocast_dtype(dev) if on else t.dtype


def _scaled_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, inv_temp: Tensor) -> Tensor:
    """[c, H] rows already divided by T (compute dtype) -> [c, V] fp32 logits / T (a fresh tensor callers may
    modify in place). Dividing the [c, H] rows rather than the [c, V] logits saves a pass over the vocabulary."""
    z = mm_f32(hidden, weight.T)
    return z if bias is None else z.add_(bias.float()[None] * inv_temp[:, None])


KEEP_BYTES = 256 << 20  # CPU: fp32 log-probs kept from forward to backward (SmolLM2, 1,300 action tokens)


class _ChunkedLogProbs(torch.autograd.Function):
    """Forward: per chunk, logits -> log-sum-exp, target log-prob, entropy; only [A]-sized results are kept.
    Backward: per chunk, recompute the logits once and form the logit gradient in place,
        dL/dz = g_lp * (onehot(target) - p) - g_ent * p * (log p + H),
    then grad_hidden = dz @ W / T and grad_W += dz^T @ (hidden / T). One extra vocabulary matmul per chunk
    compared with keeping the logits, and at most two [c, V] buffers alive at a time. On a CPU, where memory is
    plentiful and the matmul is the cost, the forward keeps the log-probs of up to KEEP_BYTES and the backward
    uses them instead (once: a second backward recomputes).

    Precision: every vocabulary matmul, forward and backward, runs in the compute dtype (autocast's dtype, or the
    weight's own under FSDP2 mixed precision: bf16 tensor cores on CUDA) with fp32 accumulation; the softmax
    statistics and dL/dz are fp32. The backward runs outside autocast, so the dtype is recorded in forward and
    the weight is cast once per call (not per chunk). In fp32 nothing is cast: the CPU path stays exact."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, inv_temp, chunk_size, with_entropy):
        n = hidden.shape[0]
        cdtype = compute_dtype(weight)
        w = weight.to(cdtype)
        # logits / T == (hidden / T) @ W^T; the division in fp32, so that 1/T is not rounded to bf16 first
        scaled = (hidden.float() * inv_temp[:, None]).to(cdtype)
        lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse, ent = torch.empty_like(lp), torch.empty_like(lp)
        # only for a backward to come: reference and teacher passes run without gradients
        keep = (
            any(ctx.needs_input_grad[:3])
            and hidden.device.type == "cpu"
            and n * weight.shape[0] * 4 <= KEEP_BYTES
        )
        ctx.kept = [] if keep else None
        for s in range(0, n, chunk_size):
            sl = slice(s, s + chunk_size)
            z = _scaled_logits(scaled[sl], w, bias, inv_temp[sl])
            lse[sl] = torch.logsumexp(z, -1)
            lp[sl] = z.gather(-1, targets[sl, None])[:, 0] - lse[sl]
            if with_entropy:  # H = lse - sum_k p_k z_k
                ent[sl] = lse[sl] - (z - lse[sl, None]).exp_().mul_(z).sum(-1)
            if keep:
                ctx.kept.append(z.sub_(lse[sl, None]))
        ctx.save_for_backward(scaled, weight, bias, targets, inv_temp, lse, ent)
        ctx.chunk_size, ctx.with_entropy, ctx.cdtype, ctx.hidden_dtype = (
            chunk_size,
            with_entropy,
            cdtype,
            hidden.dtype,
        )
        # an unused output (entropy as a mere metric) then costs no backward work
        ctx.set_materialize_grads(False)
        return lp, (ent if with_entropy else lp.new_empty(0))

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        scaled, weight, bias, targets, inv_temp, lse, ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        w = weight.to(ctx.cdtype)
        grad_h = torch.zeros(scaled.shape, dtype=torch.float32, device=scaled.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        if g_lp is None:
            g_lp = torch.zeros_like(lse)
        use_ent = ctx.with_entropy and g_ent is not None
        kept, ctx.kept = ctx.kept, None  # consumed in place below
        for i, s in enumerate(range(0, scaled.shape[0], ctx.chunk_size)):
            sl = slice(s, s + ctx.chunk_size)
            logp = kept[i] if kept else _scaled_logits(scaled[sl], w, bias, inv_temp[sl]).sub_(lse[sl, None])
            gl = g_lp[sl, None]
            if use_ent:  # dz = -p * (g_lp + g_ent * (log p + H))
                p = logp.exp()
                dz = logp.add_(ent[sl, None]).mul_(g_ent[sl, None]).add_(gl).mul_(p).neg_()
                del p
            else:  # dz = -p * g_lp, in the same buffer
                dz = logp.exp_().mul_(-gl)
            dz = dz.scatter_add_(-1, targets[sl, None], gl)
            if need_b:
                grad_b.addmv_(dz.T, inv_temp[sl])
            dz = dz.to(ctx.cdtype)
            if need_h:
                grad_h[sl] = mm_f32(dz, w)
            if need_w and dz.dtype == torch.float32:
                grad_w.addmm_(dz.T, scaled[sl])  # in place: no [V, H] temporary on the exact fp32 path
            elif need_w:
                grad_w += mm_f32(dz.T, scaled[sl])
        if need_h:  # d(hidden / T)/d hidden = 1 / T
            grad_h = grad_h.mul_(inv_temp[:, None]).to(ctx.hidden_dtype)
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(weight.dtype),
            None,
            None,
            None,
            None,
        )


def gathered_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: Tensor,
    *,
    chunk_size: int = 512,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob (and entropy) of `targets` [A] given the rows `hidden` [A, H] that predict them.

    temperature: [A] per-row temperature (0 means 1). Returns ([A] fp32, [A] fp32 or None)."""
    temperature = temperature.float()
    inv_temp = 1.0 / torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    lp, ent = _ChunkedLogProbs.apply(hidden, weight, bias, targets, inv_temp, chunk_size, with_entropy)
    return lp, (ent if with_entropy else None)


def action_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    input_ids: Tensor,
    act_index: Tensor,
    act_temperature: Tensor,
    *,
    chunk_size: int = 512,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs (and entropy) of the action tokens of a batch.

    hidden: [B, L, H] final hidden states; input_ids: [B, L]; act_index: [A] flat positions of the action
    tokens (`MicroBatch.act_index`; position t is predicted by row t - 1 of the same sequence); act_temperature: [A].
    Index tensors instead of boolean masks: gathers and scatters whose backward needs no device sync.
    Returns [B, L] fp32 tensors, zero off the action tokens."""
    flat_h = hidden.flatten(0, 1)
    lp, ent = gathered_logprobs(
        flat_h.index_select(0, act_index - 1),
        weight,
        bias,
        input_ids.flatten().index_select(0, act_index),
        act_temperature,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
    )
    return scatter_actions(lp, act_index, input_ids.shape), (
        scatter_actions(ent, act_index, input_ids.shape) if ent is not None else None
    )


def scatter_actions(values: Tensor, act_index: Tensor, shape: torch.Size) -> Tensor:
    """[A] values of the action tokens -> [R, L] fp32, zero elsewhere: a new tensor, not a view (FSDP2 hooks a
    module's outputs for its backward)."""
    out = torch.zeros(shape, dtype=torch.float32, device=values.device)
    out.view(-1).index_copy_(0, act_index, values)
    return out


def hidden_states(base: nn.Module, decoder: nn.Module, mb) -> Tensor:
    """[R, L, H] last hidden states of a micro-batch. With images, a vision-language model's base model merges
    their features into the embeddings (positions by `rope_positions`: Qwen2-VL); otherwise the decoder runs,
    on embeddings plus 0 times the features of `mb.blank` when set (`molt.trainer.batching.blank_image`)."""
    inputs = mb.decoder_inputs()
    dtype = base.get_input_embeddings().weight.dtype  # FSDP2's param_dtype here (its root casts no inputs)
    images, blank = (
        {
            k: v.to(dtype) if isinstance(v, Tensor) and v.is_floating_point() else v
            for k, v in (x or {}).items()
        }
        for x in (mb.images, mb.blank)
    )
    if images:
        positions = rope_positions(base, mb.input_ids, mb.attention_mask, None, images)[0]
        return base(**inputs, position_ids=positions, **images).last_hidden_state
    if blank:
        features = tree_leaves(base.get_image_features(**blank))
        zero = sum(t.sum() for t in features if isinstance(t, Tensor)) * 0.0
        inputs["inputs_embeds"] = decoder.get_input_embeddings()(inputs.pop("input_ids")) + zero
    return decoder(**inputs, use_cache=False).last_hidden_state


class CausalLMLogProbs(nn.Module):
    """Wraps a Hugging Face causal LM so that one `forward` (hence one FSDP root unshard) returns action-token
    log-probs instead of logits. `self.lm` keeps Hugging Face parameter names (`self.lm.state_dict()`)."""

    def __init__(self, lm: nn.Module, chunk_size: int = 512, routing=None):
        super().__init__()
        check_supported(lm.config)
        self.lm = lm
        self.chunk_size = chunk_size
        self.routing = routing  # a `molt.trainer.moe.Routing` on lm's routers (MoE), told each micro-batch
        spec = ModelSpec.from_config(lm.config)
        self._cache_kw = spec.cache_kw
        self.banned, self._ban = list(spec.banned), None  # the engine never samples these: masked here too

    def forward(self, mb, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        """mb: a `molt.trainer.batching.MicroBatch` (padded, packed, or padded with a shared prefix).
        Returns [R, L] fp32 log-probs (and entropy), zero off the action tokens."""
        decoder = self.lm.get_decoder()
        if self.routing is not None:
            self.routing.set(mb)
        if mb.prefix is None:
            hidden = hidden_states(self.lm.base_model, decoder, mb)
        else:
            hidden = self._hidden_with_shared_prefix(decoder, mb.input_ids, mb.prefix)
        head = self.lm.get_output_embeddings()
        bias = head.bias
        # -1e9 (not -inf: no inf * 0 in the backward) puts exactly 0 mass on them in fp32 and bf16
        if self.banned:
            if self._ban is None or self._ban.device != head.weight.device:
                self._ban = torch.zeros(head.weight.shape[0], device=head.weight.device).index_fill_(
                    0, torch.tensor(self.banned, device=head.weight.device), -1e9
                )
            bias = self._ban if bias is None else bias + self._ban
        return action_logprobs(
            hidden,
            head.weight,
            bias,
            mb.input_ids,
            mb.act_index,
            mb.act_temperature,
            chunk_size=self.chunk_size,
            with_entropy=with_entropy,
        )

    def _hidden_with_shared_prefix(self, decoder: nn.Module, input_ids: Tensor, prefix) -> Tensor:
        """[B, L, H] hidden states, zero over the first `prefix.length` positions (they predict no action)."""
        from transformers import DynamicCache

        p = prefix.length
        cache = DynamicCache(config=self.lm.config)
        kw = self._cache_kw
        decoder(input_ids=input_ids[prefix.rows, :p], use_cache=True, **{kw: cache})
        if cache.get_seq_length() != p:
            raise ValueError(
                f"{type(decoder).__name__} did not fill its KV cache; set --train.share_prefix false"
            )
        cache.batch_select_indices(prefix.index)
        rest = decoder(input_ids=input_ids[:, p:], use_cache=True, **{kw: cache})  # no mask: `decoder_inputs`
        hidden = rest.last_hidden_state
        return torch.cat([hidden.new_zeros(hidden.shape[0], p, hidden.shape[2]), hidden], dim=1)
