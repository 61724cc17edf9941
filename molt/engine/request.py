"""A request as an engine holds it: the record both engines share (`RequestRecord`), the embedded engine's
(`Request`, which its worker thread holds) and how it completes. No torch at import: `molt.engine.vllm` stays
light.

Design notes and decisions: docs/internals.md, section `molt/engine/hf.py`.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from dataclasses import dataclass, field
from typing import Any

from molt.engine.base import EngineError, check_request
from molt.types import Completion, FinishReason, SamplingParams


@dataclass(eq=False, kw_only=True)
class RequestRecord:
    """What every engine records of a request (vLLM's `_Request` and `Request` below extend it)."""

    id: str
    prompt: list[int]
    params: SamplingParams
    max_new: int  # max_tokens capped by the context window
    stops: list[int]  # EOS ids + params.stop_token_ids
    on_tokens: Any = None  # called with each new token id (streaming)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish: FinishReason | None = None
    aborted: bool = False

    @classmethod
    def admit(
        cls, engine: Any, prompt: list[int], params: SamplingParams, request_id: str | None, **fields: Any
    ) -> Any:
        """A checked request (`check_request`: RequestError names what is wrong) of `engine`, with its stops."""
        max_new = check_request(
            prompt,
            params,
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
            model_name=engine.model_name,
        )
        return cls(
            id=request_id or uuid.uuid4().hex,
            prompt=prompt,
            params=params,
            max_new=max_new,
            stops=sorted(set(engine.eos_token_ids) | set(params.stop_token_ids)),
            **fields,
        )

    def routed_experts(self) -> Any:
        """MoE: the experts of every position but the last, as a numpy array [positions, layers, k], or None."""
        return None

    def completion(self) -> Completion:
        return Completion(
            list(self.tokens),
            list(self.logprobs),
            list(self.versions),
            self.finish,
            top_logprobs=self.top if self.params.top_logprobs else None,
            prompt_tokens=len(self.prompt),
            routed_experts=self.routed_experts(),
        )


@dataclass(eq=False, kw_only=True)
class Request(RequestRecord):
    generator: random.Random
    loop: asyncio.AbstractEventLoop  # on_tokens and the future are called on it
    future: asyncio.Future
    images: Any = None  # processor inputs of the prompt's images (vision-language models)
    session_id: str | None = None  # key of the prefix cache
    adapter: str = ""  # the LoRA adapter it samples with, of several (`ModelRunner.adapters`)
    rope_offset: int = 0  # M-RoPE: next position = tokens so far + rope_offset (`rope_positions`)
    routes: list[Any] = field(default_factory=list)  # MoE: [n, layers, k] tensors of positions 0..routed
    routed: int = 0
    # a constrained request's llguidance matcher, at its tokens so far (`HFEngine._matcher`)
    matcher: Any = None

    def route(self, start: int, rows: Any) -> None:
        """Routes of context positions start...; a position keeps the first one it got (see module doc)."""
        if rows is not None and start + len(rows) > self.routed:
            self.routes.append(rows[self.routed - start :])
            self.routed = start + len(rows)

    def routed_experts(self) -> Any:
        import torch

        return torch.cat(self.routes).numpy() if self.routes else None


def resolve(req: Request, result: Any = None, error: BaseException | None = None) -> None:
    """Complete the request's future from the worker thread (it may already be cancelled)."""

    def done() -> None:
        if not req.future.done():
            req.future.set_exception(error) if error else req.future.set_result(result)

    req.loop.call_soon_threadsafe(done)


def failed(error: BaseException) -> EngineError:
    """What a request the engine failed ends with: an EngineError naming the cause (the capture server's 500)."""
    return error if isinstance(error, EngineError) else EngineError(f"the engine failed: {error!r}")
