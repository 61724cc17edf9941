"""The engine contract: token IDs in; sampled token IDs, behavior log-probabilities and policy versions out.

Design notes and decisions: docs/internals.md, section `molt/engine/base.py`.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

from molt.types import Completion, SamplingParams


class EngineError(RuntimeError):
    """The engine failed (a step raised, a weight it was sent does not fit, its process died): not the caller's
    mistake. The capture server answers 500 (503 for `EngineGone`); the CLI prints its traceback."""


class EngineGone(EngineError):
    """The engine is closed or its process is gone: a new one may take its place (the capture server's 503)."""


class RequestError(ValueError):
    """A request the engine cannot serve (a prompt longer than the context window, bad sampling params, an image
    for a text model): the caller's mistake, which the capture server answers with a 400."""


def copy_weights(params: dict[str, Any], named_tensors: Iterable[tuple[str, Any]], model_name: str) -> None:
    """Copy (HF name, tensor) pairs into a model's `state_dict()` tensors in place, checking names and shapes
    (tied embeddings share storage, so either name updates both)."""
    import torch

    with torch.no_grad():
        for name, tensor in named_tensors:
            target = params.get(name)
            if target is None:
                raise EngineError(f"update_weights: {name!r} is not a parameter of {model_name}")
            if tuple(target.shape) != tuple(tensor.shape):
                raise EngineError(
                    f"update_weights: {name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(target.shape)}"
                )
            if target.dtype == torch.bfloat16 and tensor.dtype == torch.float32:
                tensor = rounded_stochastically(tensor)
            target.copy_(tensor)


def rounded_stochastically(t: Any) -> Any:
    """fp32 `t` rounded to bf16 up or down at random, in proportion to its distance from each (as fp32 values):
    unbiased, so a bf16 engine samples from the trained weights on average. Rounded to nearest, most of a small
    update vanishes: at lr 5e-6, 86% of the weights that moved kept their bf16 value (docs/internals.md)."""
    import torch

    # four 16-bit draws from each 64-bit one: 0.24 s over SmolLM2-135M against randint_like's 0.59 (one thread)
    draws = torch.empty((t.numel() + 3) // 4, dtype=torch.int64, device=t.device).random_(-(2**63), None)
    bits = draws.view(torch.int16)[: t.numel()].view(t.shape).to(torch.int32).bitwise_and_(65535)
    bits.add_(t.contiguous().view(torch.int32)).bitwise_and_(-65536)  # the low 16 bits dropped: toward 0
    return bits.view(torch.float32)


def pack_weights(bucket: list[tuple[str, Any]]) -> list[tuple[str, Any, str, tuple[int, ...]]]:
    """(HF name, tensor) pairs as (name, bytes as a numpy array, dtype, shape): Ray stores numpy arrays out of band
    and hands them back as views of its object store, where a pickled tensor is copied on both sides."""
    import torch

    return [
        (
            name,
            t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy(),
            str(t.dtype)[6:],
            tuple(t.shape),
        )
        for name, t in bucket
    ]


def unpack_weights(bucket: list[tuple]) -> list[tuple[str, Any]]:
    """`pack_weights`' inverse without a copy; (name, tensor) pairs pass unchanged."""
    import torch

    # the object store's buffers are read-only: the tensors are only read from
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return [
            entry
            if len(entry) == 2
            else (entry[0], torch.from_numpy(entry[1]).view(getattr(torch, entry[2])).view(entry[3]))
            for entry in bucket
        ]


def check_request(
    prompt: list[int], params: SamplingParams, *, max_model_len: int, vocab_size: int, model_name: str
) -> int:
    """Validate one request the same way in every engine; returns how many new tokens it may generate
    (max_tokens capped by the room left in the context window). RequestError names the problem."""
    try:
        params.validate()
    except ValueError as e:
        raise RequestError(str(e)) from None
    if not prompt:
        raise RequestError("the prompt is empty: at least one prompt token is required")
    if len(prompt) >= max_model_len:
        raise RequestError(
            f"the prompt has {len(prompt)} tokens but the context window (max_model_len) of "
            f"{model_name} is {max_model_len}: no room left to generate"
        )
    for what, ids in (("prompt", prompt), ("stop", params.stop_token_ids)):
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            raise RequestError(f"{what} token ids must be in [0, {vocab_size}) for {model_name}")
    room = max_model_len - len(prompt)
    return room if params.max_tokens is None else min(params.max_tokens, room)


def token_list(ids: Any) -> list[int]:
    """A prompt as the list of ints an engine keeps: capture sends an int32 numpy array (its bytes cross to an
    engine process without a Python object per token), other callers a list (copied: the engine owns it)."""
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)


def can_stream(engine: Any) -> bool:
    """Whether `engine.generate` accepts `on_tokens`. A wrapper (refit gate, recording engine) answers for the
    engines it wraps through a boolean `can_stream` attribute, since its own signature always has the parameter."""
    declared = getattr(engine, "can_stream", None)
    if isinstance(declared, bool):
        return declared
    return "on_tokens" in inspect.signature(engine.generate).parameters


@runtime_checkable
class Engine(Protocol):
    model_name: str  # name served on /v1/models
    max_model_len: int  # context window in tokens (prompt + completion)
    eos_token_ids: list[int]

    async def generate(
        self,
        prompt_ids: list[int],  # or an int32 numpy array (capture's): engines take `token_list(prompt_ids)`
        params: SamplingParams,
        session_id: str | None = None,  # requests of one session share the engine's prefix cache
        request_id: str | None = None,  # for abort(); cancelling the awaiting task aborts as well
        *,
        on_tokens: Callable[[list[int]], None] | None = None,  # new token ids as they are sampled
        # images: dict | None, vision-language engines only (module docstring), with `sources`: the decoded
        # images they came from, in the same order (vLLM runs the model's processor on them itself)
    ) -> Completion: ...

    async def abort(self, request_id: str) -> None: ...  # finishes the request with FinishReason.ABORT

    async def pause(self) -> None: ...

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None: ...

    async def resume(self) -> None: ...

    @property
    def version(self) -> int: ...

    async def close(self) -> None: ...
