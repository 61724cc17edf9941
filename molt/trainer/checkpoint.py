"""Resumable checkpoints with torch.distributed.checkpoint (DCP): model, optimizer, LR schedule, step and RNG.

DCP writes each rank's shards in parallel and can reshard on load (another world size restores the model and
optimizer). `get_state_dict`/`set_state_dict` give FSDP2-, TP- and single-process models the same
fully-qualified names, so one checkpoint format covers all layouts.

Decisions:
- Model, optimizer, schedule and step go through one `Stateful` object, so `dcp.save`/`dcp.load` handle them
  together (non-tensor values are pickled by DCP).
- RNG state is per rank (`rng/rank{r}`: CPU and, on GPU, CUDA generator states); each rank restores its own key,
  so it restores only when resuming with the same world size (a different world size keeps fresh RNG, with a
  warning). Ray-side and data-order state belong to the runtime.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful


class _TrainState(Stateful):
    def __init__(self, trainer):
        self.t = trainer

    def options(self) -> StateDictOptions:
        """With LoRA the frozen base is not written (a resumed trainer loads it from the model path again)."""
        lora = bool(self.t.optim_cfg.lora_rank)
        return StateDictOptions(ignore_frozen_params=lora, strict=not lora)

    def state_dict(self) -> dict:
        # optimizers: AdamW, Muon
        model_sd, optim_sd = get_state_dict(self.t.model, self.t.optimizers, options=self.options())
        return {
            "model": model_sd,
            "optim": optim_sd,
            "scheduler": [s.state_dict() for s in self.t.schedulers],
            "step": self.t.step,
        }

    def load_state_dict(self, sd: dict) -> None:
        set_state_dict(
            self.t.model,
            self.t.optimizers,
            model_state_dict=sd["model"],
            optim_state_dict=sd["optim"],
            options=self.options(),
        )
        for schedule, state in zip(self.t.schedulers, sd["scheduler"], strict=True):
            schedule.load_state_dict(state)
        self.t.step = int(sd["step"])


def _rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device).cpu()
    return state


def save_checkpoint(path: str, trainer) -> None:
    """Write a DCP checkpoint directory at `path` (collective)."""
    dcp.save(
        {"train": _TrainState(trainer), "rng": {f"rank{trainer.rank}": _rng_state(trainer.device)}},
        checkpoint_id=str(path),
    )


def load_checkpoint(path: str, trainer) -> None:
    """Restore a trainer built with the same config from `save_checkpoint(path, ...)` (collective)."""
    from torch.distributed.checkpoint import FileSystemReader

    state = {"train": _TrainState(trainer), "rng": {f"rank{trainer.rank}": _rng_state(trainer.device)}}
    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    if not any(k.startswith(f"rng.rank{trainer.rank}.") for k in saved):
        warnings.warn(f"checkpoint {path} has no RNG state for rank {trainer.rank}; keeping the current RNG")
        del state["rng"]
    dcp.load(state, checkpoint_id=str(path))
    if "rng" in state:
        rng = state["rng"][f"rank{trainer.rank}"]
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], trainer.device)
