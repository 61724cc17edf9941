"""Session-sticky routing over several engines; the router is itself an `Engine`.

Design notes and decisions: docs/internals.md, section `molt/engine/router.py`.
"""

from __future__ import annotations

import asyncio
import uuid
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

from molt.engine.base import Engine, can_stream
from molt.types import Completion, SamplingParams


class Router:
    def __init__(self, engines: Sequence[Engine]):
        if not engines:
            raise ValueError("Router needs at least one engine")
        names = {e.model_name for e in engines}
        if len(names) != 1:
            raise ValueError(f"all engines behind one router must serve the same model, got {sorted(names)}")
        self.engines = list(engines)
        self.model_name = self.engines[0].model_name
        self.max_model_len = min(e.max_model_len for e in self.engines)
        self.eos_token_ids = list(self.engines[0].eos_token_ids)
        self._load = [0] * len(self.engines)  # requests in flight per engine
        self._owner: dict[str, int] = {}  # request_id -> engine index, for abort

    def pick(self, session_id: str | None) -> int:
        if session_id is not None:
            return zlib.crc32(session_id.encode()) % len(self.engines)
        return min(range(len(self.engines)), key=self._load.__getitem__)

    @property
    def can_stream(self) -> bool:
        return all(can_stream(e) for e in self.engines)

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        session_id: str | None = None,
        request_id: str | None = None,
        **kw: Any,
    ) -> Completion:  # on_tokens, images
        index = self.pick(session_id)
        request_id = request_id or uuid.uuid4().hex
        self._owner[request_id] = index
        self._load[index] += 1
        try:
            return await self.engines[index].generate(prompt_ids, params, session_id, request_id, **kw)
        finally:
            self._load[index] -= 1
            self._owner.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        index = self._owner.get(request_id)
        if index is not None:
            await self.engines[index].abort(request_id)

    async def pause(self) -> None:
        await asyncio.gather(*[e.pause() for e in self.engines])

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        named = list(named_tensors)
        await asyncio.gather(*[e.update_weights(named, version) for e in self.engines])

    async def resume(self) -> None:
        await asyncio.gather(*[e.resume() for e in self.engines])

    @property
    def version(self) -> int:
        return min(e.version for e in self.engines)  # the oldest policy any request may still be sampled from

    async def close(self) -> None:
        await asyncio.gather(*[e.close() for e in self.engines])
