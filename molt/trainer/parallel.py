"""Process groups, device meshes, FSDP2 sharding, tensor parallelism and DTensor-aware gradient clipping.

Design notes and decisions: docs/internals.md, section `molt/trainer/parallel.py`.
"""

from __future__ import annotations

import fnmatch
import math
import os

import torch
import torch.distributed as dist
from torch import nn


def resolve_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(device: torch.device, one_rank: bool = False) -> tuple[int, int]:
    """Join the process group that torchrun (or a caller) set up through the environment; (rank, world).
    A single process gets a one-rank group (in-process store) only when `one_rank`."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group(backend=backend)
    elif not dist.is_initialized() and one_rank:
        # gloo beside NCCL wherever CUDA exists: a later trainer in this process may hold CPU tensors (a CPU
        # mesh after a CUDA one, as in the GPU check's tests); one rank, so gloo opens no connection
        both = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=both, store=dist.HashStore(), rank=0, world_size=1)
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def build_mesh(device: torch.device, world: int, tp_size: int, one_rank: bool = False):
    """A ("dp",) or ("dp", "tp") DeviceMesh over the world; None for a single process unless `one_rank`."""
    from torch.distributed.device_mesh import init_device_mesh

    if world % tp_size:
        raise ValueError(f"tp_size {tp_size} must divide the world size {world}")
    if world == 1 and not one_rank:
        return None
    if tp_size == 1:
        return init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    return init_device_mesh(device.type, (world // tp_size, tp_size), mesh_dim_names=("dp", "tp"))


def decoder_layers(lm: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a HF model: modules whose class is in its `_no_split_modules`."""
    names = set(getattr(lm, "_no_split_modules", None) or ())
    layers = [m for m in lm.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(lm).__name__} declares no decoder block classes (_no_split_modules)")
    return layers


def apply_tensor_parallel(lm: nn.Module, tp_mesh) -> None:
    """Split the decoder's linear layers over `tp_mesh` following `config.base_model_tp_plan`."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = getattr(lm.config, "base_model_tp_plan", None) or {}
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    decoder = lm.get_decoder()
    tp = tp_mesh.size()
    cfg = lm.config
    for heads in ("num_attention_heads", "num_key_value_heads"):
        if getattr(cfg, heads, tp) % tp:
            raise ValueError(f"tp_size {tp} must divide {heads} ({getattr(cfg, heads)})")
    resolved = {}
    for name, module in decoder.named_modules():
        for pattern, style in plan.items():
            if name and fnmatch.fnmatchcase(name, pattern):
                if style not in styles:
                    raise ValueError(
                        f"tp_size > 1: style {style!r} of {pattern!r} is not supported on this "
                        "path (dense colwise/rowwise only; experts need expert parallelism)"
                    )
                resolved[name] = styles[style]()
    if not resolved:
        raise ValueError(f"tp_size > 1: {type(lm).__name__} has no tensor-parallel plan")
    parallelize_module(decoder, tp_mesh, resolved)


def shard(
    model: nn.Module,
    layers: list[nn.Module],
    mesh,
    *,
    param_dtype: torch.dtype,
    offload: bool,
    keep_unsharded: bool = False,
) -> None:
    """FSDP2: `fully_shard` each decoder block, then the root `model`, over the mesh's "dp" dimension.
    `keep_unsharded` (one rank, where "unsharded" costs only the cast copy): blocks stay unsharded between
    forward, backward and the next micro-batch until `reshard(model)`."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    offload_policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    kwargs = {
        "mesh": mesh["dp"],
        "mp_policy": mp,
        "offload_policy": offload_policy,
        "reshard_after_forward": not keep_unsharded,
    }
    for layer in layers:
        fully_shard(layer, **kwargs)
    # The root's input is the whole micro-batch: cast to param_dtype it rounded the sampling temperature to
    # bf16 (0.7 -> 0.69921875) and copied every fp32 per-token tensor. The blocks cast their own inputs; the
    # images are cast where the model takes them (`molt.trainer.logprobs.hidden_states`).
    root_mp = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    fully_shard(model, **{**kwargs, "mp_policy": root_mp})
    if keep_unsharded:
        model.set_reshard_after_backward(False)  # recurses into the blocks


def reshard(model: nn.Module) -> None:
    """Free the unsharded parameters of every FSDP2 module under `model` (see `shard(keep_unsharded=True)`)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def dp_size(mesh) -> int:
    return 1 if mesh is None else mesh["dp"].size()


def all_reduce_sum(t: torch.Tensor, mesh) -> torch.Tensor:
    """In-place sum over the data-parallel group (a no-op for a single process)."""
    if mesh is not None:
        dist.all_reduce(t, group=mesh["dp"].get_group())
    return t


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """Total L2 norm of all gradients (plain tensors or DTensors on any meshes); scales them to at most
    `max_norm` when max_norm > 0. Returns the norm before clipping (the step's one read of a device value
    besides its metrics). Norms are taken with one `_foreach_norm` per (mesh, copies) group, not per tensor."""
    from torch.distributed.tensor import DTensor, Replicate

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    groups: dict = {}  # (mesh, copies) -> local shards; a mesh's shards are reduced over that mesh only
    for g in grads:
        if isinstance(g, DTensor):  # what is replicated on some mesh dimension is divided by its copies
            copies = math.prod(
                g.device_mesh.size(i) for i, pl in enumerate(g.placements) if isinstance(pl, Replicate)
            )
            groups.setdefault((g.device_mesh, copies), []).append(g.to_local())
        else:
            groups.setdefault((None, 1), []).append(g)
    per_mesh: dict = {}
    for (mesh, copies), local in groups.items():
        norms = torch._foreach_norm(local)
        sq = torch.stack([n.to(norms[0].device) for n in norms]).double().square().sum() / copies
        per_mesh[mesh] = per_mesh.get(mesh, 0.0) + sq
    total = 0.0
    for mesh, sq in per_mesh.items():
        if mesh is not None:
            # offloaded gradients sit on CPU; NCCL reduces device tensors only
            if dist.get_backend() == "nccl":
                sq = sq.cuda()
            for dim in range(mesh.ndim):  # a sum over every dimension is the sum over the whole mesh
                dist.all_reduce(sq, group=mesh.get_group(dim))
        total += float(sq)
    norm = math.sqrt(total)
    if max_norm > 0 and norm > max_norm:
        torch._foreach_mul_([t for local in groups.values() for t in local], max_norm / (norm + 1e-6))
    return norm
