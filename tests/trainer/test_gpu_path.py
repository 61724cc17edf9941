"""The GPU path's properties, checked on the CPU: vocabulary matmuls in the compute dtype, no device reads
per micro-batch, and FSDP2's mixed precision on a one-rank mesh with one weight cast per step."""

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from trainer_helpers import BASE, full_params, make_window

from molt.trainer.logprobs import gathered_logprobs

aten = torch.ops.aten
# ops that make the host wait for the device on CUDA (a value read back, or an output size that depends on data)
SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor,
}


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _host_side() -> bool:
    """Ops that run on host tensors on a GPU too: collation (before the copy to the device) and the
    optimizer's step counters (CPU tensors unless capturable)."""
    return any(
        f.filename.endswith(("molt/trainer/batching.py", "torch/optim/adam.py", "torch/optim/optimizer.py"))
        for f in traceback.extract_stack()
    )


class Recorder(TorchDispatchMode):
    """Records every aten op: (op, [(dtype, shape)] of its tensor inputs, [(dtype, numel)] of its outputs,
    whether it would make the host wait for a GPU)."""

    def __init__(self):
        super().__init__()
        self.calls = []
        self.weight_casts = 0  # elements FSDP2 cast to bf16 for its unsharded parameters

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = _tensors(list(args) + list(kwargs.values()))
        bool_index = func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and any(
            t.dtype == torch.bool for t in _tensors(args[1:2])
        )
        sync = (func in SYNC_OPS or bool_index) and not _host_side()
        self.calls.append(
            (
                func,
                [(t.dtype, tuple(t.shape)) for t in inputs],
                [(t.dtype, t.numel()) for t in _tensors(out)],
                sync,
            )
        )
        if func == aten._to_copy.default and any(
            f.filename.endswith("_fsdp_param.py") for f in traceback.extract_stack()
        ):
            self.weight_casts += sum(n for dtype, n in self.calls[-1][2] if dtype == torch.bfloat16)
        return out

    def syncs(self) -> int:
        return sum(1 for *_, sync in self.calls if sync)


@pytest.mark.parametrize("keep", [True, False])
def test_vocabulary_matmuls_run_in_the_autocast_dtype_forward_and_backward(keep, monkeypatch):
    import molt.trainer.logprobs as lps

    if not keep:  # the GPU's way: the backward recomputes the logits
        monkeypatch.setattr(lps, "KEEP_BYTES", 0)
    torch.manual_seed(0)
    a, h, v = 12, 16, 300
    hidden = torch.randn(a, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)  # the fp32 master weight
    targets, temp = torch.randint(0, v, (a,)), torch.full((a,), 0.7)
    with Recorder() as rec:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp, ent = gathered_logprobs(hidden, weight, None, targets, temp, chunk_size=5, with_entropy=True)
        (lp.sum() + ent.sum()).backward()  # the backward runs outside autocast, as in a training step
    vocab_mms = [
        (f, [d for d, _ in ins])
        for f, ins, _, _ in rec.calls
        if f in (aten.mm.default, aten.addmm.default) and any(v in shape for _, shape in ins)
    ]
    # per chunk of 5 (3 chunks): forward logits, backward recompute (unless kept), grad_hidden, grad_weight
    assert len(vocab_mms) == 3 * (3 if keep else 4)
    assert all(dtypes[-2:] == [torch.bfloat16, torch.bfloat16] for _, dtypes in vocab_mms), vocab_mms
    assert (
        lp.dtype == torch.float32
        and weight.grad.dtype == torch.float32
        and hidden.grad.dtype == torch.float32
    )
    with torch.no_grad():  # bf16 matmuls, fp32 softmax: close to the fp32 result
        ref = torch.log_softmax((hidden @ weight.T) / 0.7, -1).gather(-1, targets[:, None])[:, 0]
    assert (lp - ref).abs().max() < 0.1 and (lp - ref).abs().max() > 0  # it did run in bf16


def _syncs_per_step(actor, window) -> int:
    with Recorder() as rec:
        actor.train_step(window)
    return rec.syncs()


@pytest.mark.parametrize(
    "pack,level,loss",
    [(False, "token", "ppo"), (True, "token", "ppo"), (True, "geo", "gspo"), (True, "seq", "ppo")],
)
def test_a_step_reads_nothing_back_per_micro_batch(tiny_llama_dir, pack, level, loss):
    from molt.trainer import Actor

    window = make_window(tiny_llama_dir, n=8, seed=1)
    counts = {}
    for budget in (10_000, 40):  # one micro-batch, then several
        actor = Actor.from_pretrained(
            tiny_llama_dir,
            **{
                **BASE,
                "train.max_tokens_per_gpu": budget,
                "actor.policy_loss": loss,
                "fsdp.packing_samples": pack,
                "algo.advantage.is_correction_level": level,
                "algo.advantage.is_correction_mode": "mask",
                "train.share_prefix": False,
            },
        )
        plan, _, _ = actor.schedule(window)
        counts[len(plan)] = _syncs_per_step(actor, window)
    (one, n_one), (many, n_many) = sorted(counts.items())
    assert one == 1 and many >= 4
    assert n_many == n_one, counts  # nothing per micro-batch
    assert n_one <= 2, counts  # the step's end: the gradient norm, the metrics


def test_one_rank_mesh_applies_mixed_precision_and_casts_weights_once_per_step(tiny_llama_dir):
    from torch.distributed.fsdp import FSDPModule

    from molt.trainer import Actor

    with pytest.raises(ValueError, match="offload"):
        # nothing to offload: refused, not ignored
        Actor.from_pretrained(tiny_llama_dir, **{"fsdp.device": "cpu", "fsdp.offload": True})
    window = make_window(tiny_llama_dir, n=8, seed=1)
    cast = {}
    for budget in (10_000, 40):
        actor = Actor.from_pretrained(
            tiny_llama_dir, **{"actor.dtype": "bfloat16", "train.max_tokens_per_gpu": budget}, **BASE
        )
        assert actor.mesh is not None and actor.mesh["dp"].size() == 1 and isinstance(actor.model, FSDPModule)
        n_params = sum(p.numel() for p in actor.model.parameters())
        plan, _, _ = actor.schedule(window)
        with Recorder() as rec:
            metrics = actor.train_step(window)
        assert metrics["actor_grad_norm"] > 0 and metrics["policy_loss"] == metrics["policy_loss"]
        cast[len(plan)] = rec.weight_casts
        assert all(p.dtype == torch.float32 for p in actor.model.parameters())  # fp32 master weights
    (_, c_one), (many, c_many) = sorted(cast.items())
    assert many >= 4 and c_one == c_many == n_params, (n_params, cast)  # once a step, however many passes
    with torch.no_grad():  # the bf16 policy computes nearly the fp32 log-probs
        lp16 = Actor.from_pretrained(tiny_llama_dir, **{"actor.dtype": "bfloat16"}, **BASE).compute_logprobs(
            window[:2]
        )
        lp32 = Actor.from_pretrained(tiny_llama_dir, **BASE).compute_logprobs(window[:2])
    gap = max(abs(a - b) for x, y in zip(lp16, lp32) for a, b in zip(x, y))
    assert 0 < gap < 0.2


def test_one_rank_mesh_hands_the_exact_temperature_to_the_log_prob_kernel(tiny_llama_dir, monkeypatch):
    """FSDP2 casts a root module's floating inputs to its param dtype by default, here the whole micro-batch:
    a sampling temperature of 0.7 reached the log-prob kernel as bf16's 0.69921875, a bias of every ratio."""
    from molt.trainer import Actor, logprobs

    seen, real = [], logprobs.gathered_logprobs

    def spy(hidden, weight, bias, targets, temperature, **kw):
        seen.append(temperature)
        return real(hidden, weight, bias, targets, temperature, **kw)

    monkeypatch.setattr(logprobs, "gathered_logprobs", spy)
    window = make_window(tiny_llama_dir, n=4, seed=1)
    for exp in window:
        exp.temperature = 0.7
    Actor.from_pretrained(tiny_llama_dir, **{"actor.dtype": "bfloat16"}, **BASE).compute_logprobs(window)
    assert seen and all(t.dtype == torch.float32 and bool((t == torch.tensor(0.7)).all()) for t in seen), seen


def test_one_rank_mesh_checkpoints_resume_and_export_exactly(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from molt.trainer import Actor

    actor = Actor.from_pretrained(tiny_llama_dir, **{"actor.dtype": "bfloat16"}, **BASE)
    actor.train_step(make_window(tiny_llama_dir, seed=1))
    actor.save(str(tmp_path / "ckpt"))
    actor.train_step(make_window(tiny_llama_dir, seed=2))
    after = full_params(actor)
    resumed = Actor.from_pretrained(tiny_llama_dir, **{"actor.dtype": "bfloat16"}, **BASE)
    resumed.load(str(tmp_path / "ckpt"))
    resumed.train_step(make_window(tiny_llama_dir, seed=2))
    assert all(torch.equal(full_params(resumed)[k], v) and v.dtype == torch.float32 for k, v in after.items())
    actor.export_hf(str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert all(torch.equal(exported[k], after[k]) for k in after)


def test_kept_logits_give_the_recomputed_gradients(monkeypatch):
    """CPU: the backward takes the forward's log-probs (KEEP_BYTES) instead of recomputing them; fp32 gradients
    are the recomputing path's, and a second backward (retain_graph) recomputes rather than reuse a spent buffer."""
    import molt.trainer.logprobs as lps

    torch.manual_seed(0)
    a, h, v = 12, 16, 300
    base = (torch.randn(a, h), torch.randn(v, h))
    targets, temp = torch.randint(0, v, (a,)), torch.full((a,), 0.7)

    def grads(keep_bytes: int, twice: bool = False):
        monkeypatch.setattr(lps, "KEEP_BYTES", keep_bytes)
        hidden, weight = (t.clone().requires_grad_() for t in base)
        lp, ent = gathered_logprobs(hidden, weight, None, targets, temp, chunk_size=5, with_entropy=True)
        loss = (lp * torch.linspace(-1, 1, a)).sum() + 0.1 * ent.sum()
        loss.backward(retain_graph=twice)
        if twice:
            loss.backward()
        return hidden.grad, weight.grad

    kept, recomputed = grads(1 << 30), grads(0)
    for x, y in zip(kept, recomputed):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
    for x, y in zip(grads(1 << 30, twice=True), recomputed):
        torch.testing.assert_close(x, 2 * y, rtol=1e-6, atol=1e-7)
