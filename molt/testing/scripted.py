"""`ScriptedEngine`: an `Engine` that answers with scripted texts, for unit tests of capture logic and for
measuring the capture server's own cost (it does no model work).

Each `generate` replies with the next scripted text (cycling), or with `reply(prompt_ids, params)` when a
function is given, tokenized by a real tokenizer and followed by the first EOS id (unless the text is marked
`no_eos=True` or max_tokens cuts it: finish reason LENGTH). Log-probabilities are fake but deterministic
(-0.01 * (position + 1)); versions are the engine's current version. Every call is recorded in `calls`
(prompt ids, params, session id) so tests can check exactly what the engine saw. With `on_tokens` the reply is
streamed one token at a time, `token_delay` seconds apart. Tests only: the real
demonstrations use `molt.engine.hf.HFEngine`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

from molt.engine.base import RequestError, can_stream, token_list
from molt.types import Completion, FinishReason, SamplingParams


class ScriptedEngine:
    def __init__(
        self,
        tokenizer: Any,
        replies: Sequence[str] | Callable[[list[int], SamplingParams], str] = ("ok",),
        *,
        model_name: str = "scripted",
        max_model_len: int = 512,
        delay: float = 0.0,
        no_eos: bool = False,
        version: int = 0,
        token_delay: float = 0.0,
        hold: Any = None,
    ):
        self.tokenizer, self.replies, self.model_name, self.no_eos = tokenizer, replies, model_name, no_eos
        self.max_model_len, self.eos_token_ids = max_model_len, [tokenizer.eos_token_id]
        self.delay = delay  # seconds each generate takes (to test timeouts and retries)
        self.token_delay = token_delay  # seconds between streamed tokens (with on_tokens)
        self.hold = hold  # an asyncio.Event the second half of a streamed reply waits for (tests set it)
        self.calls: list[dict[str, Any]] = []
        self._version = version
        self._encoded: dict[str, list[int]] = {}
        self._aborted: set[str] = set()
        self._waiting: dict[str, asyncio.Event] = {}  # request id -> set on abort (ends the delay early)

    @property
    def version(self) -> int:
        return self._version

    def _text(self, prompt_ids: list[int], params: SamplingParams) -> str:
        if callable(self.replies):
            return self.replies(prompt_ids, params)
        return self.replies[(len(self.calls) - 1) % len(self.replies)]

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        session_id: str | None = None,
        request_id: str | None = None,
        *,
        on_tokens: Any = None,
    ) -> Completion:
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"prompt of {len(prompt_ids)} tokens does not fit the window of {self.max_model_len}"
            )
        prompt_ids = token_list(prompt_ids)
        self.calls.append({"prompt_ids": prompt_ids, "params": params, "session_id": session_id})
        text = self._text(prompt_ids, params)
        ids = self._encoded.get(text)
        if ids is None:
            ids = self._encoded[text] = self.tokenizer.encode(text, add_special_tokens=False)
        ids = ids + ([] if self.no_eos else self.eos_token_ids[:1])
        room = self.max_model_len - len(prompt_ids)
        limit = room if params.max_tokens is None else min(params.max_tokens, room)
        finish = FinishReason.STOP if len(ids) <= limit and not self.no_eos else FinishReason.LENGTH
        ids = ids[:limit]
        if self.delay:
            aborted = self._waiting.setdefault(request_id or "", asyncio.Event())
            try:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(aborted.wait(), self.delay)
            finally:
                self._waiting.pop(request_id or "", None)
        for i, token in enumerate(ids if on_tokens is not None else ()):
            if self.hold is not None and i == len(ids) // 2:
                await self.hold.wait()
            on_tokens([token])
            await asyncio.sleep(self.token_delay)
        if request_id is not None and request_id in self._aborted:
            finish = FinishReason.ABORT
        logprobs = [-0.01 * (i + 1) for i in range(len(ids))]
        tops = (
            [[(t, lp)] * params.top_logprobs for t, lp in zip(ids, logprobs)] if params.top_logprobs else None
        )
        return Completion(
            ids,
            logprobs,
            [self._version] * len(ids),
            finish,
            top_logprobs=tops,
            prompt_tokens=len(prompt_ids),
        )

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)
        if request_id in self._waiting:
            self._waiting[request_id].set()

    async def pause(self) -> None:
        pass

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        self._version = version

    async def resume(self) -> None:
        pass

    async def close(self) -> None:
        pass


class RecordingEngine:
    """Wraps any engine and records every request and its completion, so tests can compare a captured segment
    with exactly what the engine produced: `records` = [(session_id, prompt_ids, Completion)]."""

    def __init__(self, engine: Any):
        self.inner = engine
        self.records: list[tuple[str | None, list[int], Completion]] = []

    def __getattr__(self, name: str) -> Any:  # model_name, max_model_len, eos_token_ids, abort, ...
        return getattr(self.inner, name)

    @property
    def can_stream(self) -> bool:
        return can_stream(self.inner)

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        session_id: str | None = None,
        request_id: str | None = None,
        **kw: Any,
    ) -> Completion:  # on_tokens, images
        completion = await self.inner.generate(
            prompt_ids, params, session_id=session_id, request_id=request_id, **kw
        )
        self.records.append((session_id, token_list(prompt_ids), completion))
        return completion

    def of_session(self, session_id: str) -> list[tuple[list[int], Completion]]:
        return [(p, c) for s, p, c in self.records if s == session_id]


@contextlib.asynccontextmanager
async def live_capture_server(engine: Any, tokenizer: Any, **kwargs: Any) -> AsyncIterator[Any]:
    """A capture server for `engine` on 127.0.0.1 (an ephemeral port), stopped on exit. `tokenizer` may be a
    `ChatRenderer` (one with a processor, for images)."""
    from molt.capture.render import ChatRenderer
    from molt.capture.server import CaptureServer

    renderer = tokenizer if isinstance(tokenizer, ChatRenderer) else ChatRenderer(tokenizer)
    server = CaptureServer(engine, renderer, **kwargs)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
