"""Shared helpers for the trainer tests: deterministic windows of experiences on a tiny model, and the
2-rank gloo worker (spawned with torch.multiprocessing)."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import torch

from molt.types import Experience

# clip mode gives non-trivial importance weights; on the CPU even where a GPU is present (the CPU fp32 path is
# the reference; tests/trainer/test_cuda.py is the GPU's)
BASE = {
    "fsdp.device": "cpu",
    "actor.adam.lr": 1e-3,
    "actor.max_norm": 1.0,
    "actor.entropy_coef": 0.01,
    "algo.advantage.is_correction_level": "token",
    "algo.advantage.is_correction_mode": "clip",
    "algo.advantage.is_correction_threshold": (0.8, 1.25),
    "actor.eps_clip_low_high": (0.2, 0.28),
    "actor.lr_scheduler": "cosine",
    "actor.lr_warmup_steps": 1,
    "actor.total_steps": 6,
}
SPLITS = {
    "mbs2_ckpt": {
        "train.micro_batch_size": 2,
        "train.max_tokens_per_gpu": 0,
        "actor.gradient_checkpoint": True,
    },
    "tok48": {"train.max_tokens_per_gpu": 48},
    "packed48": {"fsdp.packing_samples": True, "train.max_tokens_per_gpu": 48},
}


def reference_logprobs(model_dir, token_ids: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) of each next token under the checkpoint, by a plain full-logits forward."""
    lm = _cached_lm(str(model_dir))
    with torch.no_grad():
        logits = lm(torch.tensor([token_ids])).logits[0].float() / temperature
    lp = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(token_ids[1:])[:, None])[:, 0]
    return [0.0] + lp.tolist()


_LMS: dict = {}


def _cached_lm(path: str):
    from transformers import AutoModelForCausalLM

    if path not in _LMS:
        _LMS[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _LMS[path]


def make_window(model_dir, n: int = 8, seed: int = 0, noise: float = 0.3) -> list[Experience]:
    """n experiences of random lengths (prompt then actions) with behavior log-probs from the checkpoint plus
    noise (a small training-inference mismatch) and random advantages."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(8, 24)
        prompt = rng.randint(2, length - 3)
        ids = [rng.randrange(10, 380) for _ in range(length)]
        mask = [0] * prompt + [1] * (length - prompt)
        temp = rng.choice([1.0, 0.7])
        ref = reference_logprobs(model_dir, ids, temp)
        blp = [(r + rng.uniform(-noise, noise)) if m else 0.0 for r, m in zip(ref, mask)]
        out.append(
            Experience(
                rollout_id=f"r{seed}-{i}",
                group_id=f"g{i // 2}",
                segment_index=0,
                reward=0.0,
                num_tokens=length,
                num_actions=sum(mask),
                min_version=0,
                temperature=temp,
                token_ids=ids,
                action_mask=mask,
                behavior_logprobs=blp,
                versions=[0 if m else -1 for m in mask],
                advantages=[rng.gauss(0.0, 1.0) if m else 0.0 for m in mask],
            )
        )
    return out


def rank_share(exps: list[Experience], rank: int) -> list[Experience]:
    """Unequal shares (3 and 5 of 8) so that ranks run different numbers of micro-batches."""
    return exps[:3] if rank == 0 else exps[3:]


def full_params(actor) -> dict[str, torch.Tensor]:
    return {n: t.clone() for bucket in actor.iter_weights(bucket_bytes=64 << 10) for n, t in bucket}


def dist_worker(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    """One rank of the 2-rank gloo job: both micro-batch splits (2 steps each), a DCP save/resume, and one
    tensor-parallel step."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    from molt.trainer import Actor

    out = Path(out_dir)
    w1, w2, w3 = (make_window(model_dir, seed=s) for s in (1, 2, 3))
    results = {}
    for name, split in SPLITS.items():
        actor = Actor.from_pretrained(model_dir, **BASE, **split)
        metrics = [actor.train_step(rank_share(w, rank)) for w in (w1, w2)]
        results[name] = {"metrics": metrics, "params": full_params(actor)}
        if name == "tok48":  # resume: save at step k=2, run steps 3 and 4, compare with a fresh resumed actor
            actor.save(str(out / "ckpt"))
            for w in (w3, w1):
                actor.train_step(rank_share(w, rank))
            results["uninterrupted"] = full_params(actor)
            resumed = Actor.from_pretrained(model_dir, **BASE, **split)
            resumed.load(str(out / "ckpt"))
            for w in (w3, w1):
                resumed.train_step(rank_share(w, rank))
            results["resumed"] = full_params(resumed)
            results["resumed_step"] = resumed.step
    # tensor parallelism over both ranks (a (dp=1, tp=2) mesh): tp ranks see the same data
    tp_actor = Actor.from_pretrained(model_dir, **{"fsdp.tp_size": 2}, **BASE)
    results["tp"] = {"metrics": [tp_actor.train_step(w1)], "params": full_params(tp_actor)}
    if rank == 0:
        torch.save(results, out / "results.pt")
    end_rank()


def end_rank() -> None:
    """Leave a spawned rank once its results are written: both ranks past their last collective and store call
    (rank 0 holds the store), the process group destroyed, then out without the interpreter's teardown. Gloo's
    threads (four run loops and two transport loops a rank, rank 0's store too) outlive destroy_process_group,
    held from C++; a teardown beside them is what can abort a rank after its work is done (issue 46: rank 1,
    SIGABRT, "terminate called without an active exception", and no traceback, so its function had returned)."""
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def trainer_state(trainer) -> dict[str, torch.Tensor]:
    """This rank's parameters (local shards), optimizer state (step counts, moments, momentum), schedule position
    and step count, cloned: what a skipped optimizer step must leave bit-identical."""
    from torch.distributed.tensor import DTensor

    def local(t):
        t = torch.as_tensor(t)
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    out = {f"param/{n}": local(p) for n, p in trainer.model.named_parameters()}
    for i, opt in enumerate(trainer.optimizers):
        for j, p in enumerate(p for group in opt.param_groups for p in group["params"]):
            out.update({f"optim{i}/{j}/{k}": local(v) for k, v in opt.state.get(p, {}).items()})
    out["schedule"] = torch.tensor([s.last_epoch for s in trainer.schedulers])
    out["step"] = torch.tensor(trainer.step)
    return out


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def inf_gradient(actor):
    """A hook that makes the input embedding's gradient +inf everywhere (the loss stays finite)."""
    import math

    def hook(module, args, out):
        out.register_hook(lambda g: g + math.inf)

    return actor.lm.get_input_embeddings().register_forward_hook(hook)


def nonfinite_worker(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    """One rank of a 2-rank gloo job: a finite step, a NaN loss on rank 1 only (its gradients stay finite), an
    inf gradient on rank 1 only, a finite step; each rank saves its metrics and whether its state was kept."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    if rank == 1:
        os.environ["MOLT_FAULT_NAN_LOSS"] = "2"  # the second optimizer window
    torch.set_num_threads(1)
    from molt.trainer import Actor

    actor = Actor.from_pretrained(model_dir, **BASE)
    windows = [rank_share(make_window(model_dir, seed=s), rank) for s in (1, 2, 3, 4)]
    out: dict = {"metrics": [actor.train_step(windows[0])]}
    before = trainer_state(actor)
    out["metrics"].append(actor.train_step(windows[1]))
    out["nan_kept"] = same_state(trainer_state(actor), before)
    hook = inf_gradient(actor) if rank == 1 else None
    out["metrics"].append(actor.train_step(windows[2]))
    out["inf_kept"] = same_state(trainer_state(actor), before)
    if hook is not None:
        hook.remove()
    out["metrics"].append(actor.train_step(windows[3]))
    out["moved"] = not same_state(trainer_state(actor), before)
    out["step"] = actor.step
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    end_rank()
