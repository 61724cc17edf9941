"""Incremental streaming of a reply: text deltas while the engine samples, then the recorded result.

`LiveReply` runs `Session.complete` as a task and listens to it: the session reports the prompt once planned
and the engine reports each batch of sampled token ids (`on_tokens`). The wires turn `deltas()` into SSE
content deltas as they come and, once the reply is recorded, send the rest (`rest(choice)`), the tool calls,
the finish reason and usage from the same `Generation` a non-streaming request returns, so a streamed reply
assembles to exactly the recorded one.

What may be sent early. Only text that is certainly part of the final content: the decoded tokens so far,
held back from the first position where it could still change:
- a stop string, complete (the content ends before it) or possibly starting at the end of the text;
- a tool-call block, started or possibly starting (the parser's call opening, e.g. `<tool_call>`): calls are
  sent as tool-call deltas at the end and their text is not content;
- trailing whitespace (removed before a tool call, and merged into punctuation by tokenizers that clean up
  spaces) and a trailing incomplete character (an unfinished byte sequence decodes to U+FFFD).
Everything held back goes out with the end of the stream. Decoding is incremental (each batch of tokens is
decoded together with the batch before it, and the new text is the difference), so a long reply costs
linear, not quadratic, tokenizer work. Replies that cannot stream (n > 1, a forced tool
call, a parser without a known opening, an answer from the retry cache, an engine without `on_tokens`) are
sent whole at the end, as before. If the final content ever failed to start with what was sent (a tokenizer
whose decode is not prefix-stable), nothing more is sent and the session counts `stream_mismatch`. A client
that goes away mid-stream cancels the request (`cancel`): its engine requests are aborted, nothing is recorded.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING

from molt.capture.errors import ANSWERED, error_reply
from molt.capture.tools import call_opening

if TYPE_CHECKING:
    from molt.capture.session import ChatRequest, Choice, Session


class LiveReply:
    def __init__(self, session: Session, request: ChatRequest, cache_key: str | None, lookup: bool):
        self.session, self.request = session, request
        self.id = request.id
        self.created = int(time.time())
        self.prompt_tokens = 0
        self.sent = ""  # text already sent as deltas
        # the start of a tool-call block and the parser's markers (none when calls are not parsed, or the parser
        # has no known opening)
        opening = (call_opening(session.parser, None) or "").strip() if request.parse_tools else ""
        self._holds = [opening, *session.parser.markers] if opening else []
        live = (
            request.n == 1
            and request.tool_choice in ("auto", "none")
            and session.can_stream
            and (opening or not request.parse_tools)
        )
        self._queue: asyncio.Queue[list[int]] = asyncio.Queue()
        self._begun = asyncio.Event()
        self.task = asyncio.create_task(
            session.complete(request, cache_key, lookup, listener=self if live else None)
        )
        # a client that disconnects never awaits the result: retrieve a failure so it is not reported as lost
        self.task.add_done_callback(lambda t: t.cancelled() or t.exception())

    # ------------------------------------------------------------------ listener (called by the session)
    def started(self, prompt_ids: list[int]) -> None:
        self.prompt_tokens = len(prompt_ids)

    def tokens(self, ids: list[int]) -> None:
        self._queue.put_nowait(ids)
        self._begun.set()

    # ------------------------------------------------------------------ the wires' side
    async def begin(self) -> None:
        """Wait for the first tokens or the end; raises what the request raised (a client error is thus
        answered with its 4xx before any byte of the stream is sent)."""
        waiter = asyncio.ensure_future(self._begun.wait())
        try:
            await asyncio.wait({waiter, self.task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if self.task.done():
            gen = self.task.result()
            self.prompt_tokens = len(gen.prompt_ids)
            self.id = gen.id  # a retry answered from the cache: its id

    async def deltas(self) -> AsyncIterator[str]:
        ids: list[int] = []
        text, prev, read = "", 0, 0  # text of ids[:read]; ids[prev:read] is the window decoded last time
        while not (self.task.done() and self._queue.empty()):
            getter = asyncio.ensure_future(self._queue.get())
            try:
                await asyncio.wait({getter, self.task}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiting = not getter.done()
                if waiting:  # the reply ended (or we were cancelled): an item not taken stays in the queue
                    getter.cancel()
            if waiting:
                continue
            ids += getter.result()
            while not self._queue.empty():
                ids += self._queue.get_nowait()
            text, prev, read = self._extend(text, ids, prev, read)
            safe = self._safe(text)
            if len(safe) > len(self.sent):
                piece, self.sent = safe[len(self.sent) :], safe
                yield piece

    async def sse(
        self,
        start: list[bytes],
        open_text: Callable,
        delta: Callable,
        error: Callable,
        end: Callable,
    ) -> AsyncIterator[bytes]:
        """A wire's event stream: `start`, the text part opened once (`open_text() -> list[bytes]`) and its
        deltas (`delta(piece) -> bytes`) while the engine samples, then `end(gen, text) -> Iterable[bytes]`,
        where `text` yields the rest of the text part (its opening if nothing was sent). A failure after the
        first byte ends the stream with the event `error(WireError) -> bytes`."""
        for event in start:
            yield event
        async for piece in self.deltas():
            if piece == self.sent:  # the first
                for event in open_text():
                    yield event
            yield delta(piece)
        try:
            gen = await self.task
        except ANSWERED as e:
            yield error(error_reply(e))
            return

        def text() -> Iterator[bytes]:
            if not self.sent:
                yield from open_text()
            yield from map(delta, text_pieces(self.rest(gen.choices[0])))

        for event in end(gen, text()):
            yield event

    async def cancel(self) -> None:
        self.task.cancel()  # a no-op once the reply is recorded; aborts its engine requests before that

    def rest(self, choice: Choice) -> str:
        """The part of the final content not sent yet."""
        if choice.content.startswith(self.sent):
            return choice.content[len(self.sent) :]
        self.session.stats["stream_mismatch"] = self.session.stats.get("stream_mismatch", 0) + 1
        return ""

    def _extend(self, text: str, ids: list[int], prev: int, read: int) -> tuple[str, int, int]:
        """Append the text of ids[read:]: decode it with the window before it and keep the difference (a
        tokenizer may render a token differently at the start of a string, e.g. SentencePiece's leading
        space, so the window is decoded both ways). An unfinished character waits for the next tokens."""
        text_of = self.session.renderer.reply_text
        before, now = text_of(ids[prev:read]), text_of(ids[prev:])
        if now.endswith("\ufffd") or not now.startswith(before):
            return text, prev, read
        return text + now[len(before) :], read, len(ids)

    def _safe(self, text: str) -> str:
        cut = len(text.rstrip("\ufffd"))
        holds = [s for s in self.request.stop if s] + self._holds
        for s in holds:
            found = text.find(s)
            if found >= 0:
                cut = min(cut, found)
            cut = min(cut, len(text) - _partial(text, s))
        return text[:cut].rstrip()


def _partial(text: str, s: str) -> int:
    """Length of the longest proper prefix of `s` that `text` ends with."""
    for k in range(min(len(s) - 1, len(text)), 0, -1):
        if text.endswith(s[:k]):
            return k
    return 0


_PIECES = re.compile(r"\s*\S+\s*|\s+")


def text_pieces(text: str) -> list[str]:
    """Word-sized pieces of a reply, for stream deltas (the engine returns whole completions)."""
    return _PIECES.findall(text)
