"""One capture session (one rollout): wire-independent request handling, generation and recording.

Design notes and decisions: docs/internals.md, section `molt/capture/session.py`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
import uuid
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from molt.capture.render import ChatRenderer, canonical_messages, canonical_tools, message_images
from molt.capture.segments import Action, Plan, SegmentTracker, joined_ids
from molt.capture.tools import Parsed, ToolParser, call_opening
from molt.engine.base import Engine, can_stream
from molt.types import (
    Completion,
    FinishReason,
    SamplingParams,
    Segment,
    check_grammar,
    json_grammar,
    json_lark,
    sub_seed,
)


class SessionClosed(Exception):
    """The session ended (its rollout finished or timed out) while a request was using it."""


class ContextTooLong(ValueError):
    """The prompt leaves no room to generate in the model's context window."""


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]  # canonical
    tools: list[dict[str, Any]] | None  # canonical
    params: SamplingParams  # resolved (session defaults overridden by the request); seed: the request's own
    stop: list[str] = field(default_factory=list)
    n: int = 1
    parse_tools: bool = True
    tool_choice: str = "auto"  # "auto" | "none" | "required" (some tool) | "function" (the one in tool_name)
    tool_name: str | None = None
    # tool name -> {"schema"} (strict) or a grammar
    formats: dict[str, dict[str, Any]] = field(default_factory=dict)
    output: dict[str, Any] | None = None  # the JSON schema of a text reply (structured outputs)
    # its reply's id (hex; the wires prefix it)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    # its wire body's length, a bound on its characters (`_fits` walks it above)
    body_bytes: int | None = None
    role: str = ""  # the agent's (multiagent.roles): its segments are that role's


@dataclass
class Choice:
    action_ids: list[int]  # kept sampled tokens
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    content: str  # reply text: special tokens skipped, cut before a stop string, tool-call blocks removed
    tool_calls: list[dict[str, Any]]  # canonical
    finish_reason: str  # "stop" | "length" | "tool_calls"
    stop_sequence: str | None
    message: dict[str, Any]  # the canonical assistant message recorded for this choice


@dataclass
class Generation:
    id: str  # hex, the wires prefix it
    created: int
    prompt_ids: Any  # numpy [n] int32 (`Plan.prompt_ids`)
    choices: list[Choice]

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.action_ids) for c in self.choices)


@dataclass
class Turn:
    """What `chat`/`extend` return (satisfies `molt.agents.Turn`)."""

    message: dict[str, Any]
    prompt_ids: list[int]
    action_ids: list[int]
    finish_reason: str


def _turn(gen: Generation) -> Turn:
    choice = gen.choices[0]
    return Turn(choice.message, gen.prompt_ids.tolist(), choice.action_ids, choice.finish_reason)


class Session:
    """A rollout's session: URLs, key, sampling defaults, segments. Implements `molt.agents.CaptureSession`."""

    def __init__(
        self,
        *,
        session_id: str,
        api_key: str,
        root_url: str,
        engine: Engine,
        renderer: ChatRenderer,
        parser: ToolParser,
        defaults: SamplingParams,
        rollout_id: str = "",
        cache_size: int = 16,
        history_size: int = 64,
        max_chars_per_token: float = 16,
        on_close: Callable[[Session], None] | None = None,
        subagent_role: str = "",
    ):
        self.session_id, self.api_key, self.rollout_id = session_id, api_key, rollout_id
        self.subagent_role = subagent_role  # given to segments that ran beside the main conversation
        self.session_url = f"{root_url}/s/{session_id}"
        self.base_url = f"{self.session_url}/v1"
        self.engine, self.renderer, self.parser = engine, renderer, parser
        self.model_name, self.max_model_len = engine.model_name, engine.max_model_len
        self.can_stream = can_stream(engine)  # see streaming.py
        self.defaults = defaults
        # a request of more characters is refused before it is tokenized (0: off)
        self.max_chars = max_chars_per_token * self.max_model_len
        self.tracker = SegmentTracker(renderer, engine.eos_token_ids)
        self.closed = False
        self.reward: float | None = None  # set through `molt serve`'s POST /s/{id}/reward
        self.stats = {"requests": 0, "cache_hits": 0, "tool_calls": 0, "malformed_tool_calls": 0}
        self._lock = asyncio.Lock()
        self._cache: OrderedDict[str, Generation] = OrderedDict()
        self._cache_size = cache_size
        # (messages ending with the reply, tools) of the latest replies by id, for requests that continue one
        self._replies: OrderedDict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = (
            OrderedDict()
        )
        self._history_size = history_size
        self._inflight: set[str] = set()
        self._count = 0
        self._on_close = on_close

    # ---------------------------------------------------------------------- molt.agents.CaptureSession
    async def chat(
        self,
        messages: list[dict[str, Any]],
        params: SamplingParams,
        tools: list[dict[str, Any]] | None = None,
        role: str = "",
    ) -> Turn:
        request = ChatRequest(
            canonical_messages(messages, self.renderer.image),
            canonical_tools(tools),
            params,
            parse_tools=bool(tools),
            role=role,
        )
        return _turn(await self.complete(request))

    async def extend(self, text: str, params: SamplingParams) -> Turn:
        async with self._lock:
            self._check_open()
            self.stats["requests"] += 1
            plan = await asyncio.to_thread(self.tracker.plan_raw, self._fits(text))
            gen = await self._generate(plan, ChatRequest([], None, params, parse_tools=False))
        return _turn(gen)

    def decode(self, token_ids: list[int]) -> str:
        return self.renderer.decode(token_ids)

    async def close(self) -> list[Segment]:
        if not self.closed:
            self.closed = True
            for request_id in list(self._inflight):
                await self.engine.abort(request_id)
            if self._on_close is not None:
                self._on_close(self)
        segments = self.tracker.segments()
        for segment in segments:  # known only now: a subagent is a conversation the main one went on after
            if segment.break_reason == "subagent" and not segment.role:
                segment.role = self.subagent_role
        return segments

    # ---------------------------------------------------------------------- the capture path
    async def complete(
        self, request: ChatRequest, cache_key: str | None = None, lookup: bool = True, listener: Any = None
    ) -> Generation:
        """Answer one request: from the retry cache (when `lookup`), or plan -> generate -> record (and cache
        under `cache_key`). `listener` (a `streaming.LiveReply`, n == 1 only) hears the planned prompt and
        the sampled tokens as they come."""
        # a body within the limit: no O(history) walk
        if request.body_bytes is None or request.body_bytes > self.max_chars > 0:
            self._fits(request.messages, request.tools)
        async with self._lock:
            self._check_open()
            self.stats["requests"] += 1
            if lookup and cache_key is not None and cache_key in self._cache:
                self.stats["cache_hits"] += 1
                return self._cache[cache_key]
            # rendering and tokenizing grow with the conversation: in a thread, so other sessions go on meanwhile
            plan = await asyncio.to_thread(
                self.tracker.plan, request.messages, request.tools, request.params.temperature, request.role
            )
            gen = await self._generate(plan, request, listener)
            if cache_key is not None:
                _put(self._cache, cache_key, gen, self._cache_size)
            _put(
                self._replies,
                gen.id,
                (request.messages + [gen.choices[0].message], request.tools),
                self._history_size,
            )
            return gen

    def recall(self, reply_id: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None] | None:
        """(canonical messages ending with the reply, tools) of one of the session's latest replies, by the id
        a wire gave it (`resp_...`, `msg_...`); None if unknown or forgotten."""
        return self._replies.get(reply_id.rpartition("_")[2])

    def sampling(self, *, seed: int | None = None, top_logprobs: int = 0, **fields: Any) -> SamplingParams:
        """The session's defaults overridden by a request's fields that are not None; `seed` is the request's
        own (None: the session gives the call its own seed of the rollout's)."""
        return self.defaults.copy(
            seed=seed, top_logprobs=top_logprobs, **{k: v for k, v in fields.items() if v is not None}
        )

    async def _generate(self, plan: Plan, request: ChatRequest, listener: Any = None) -> Generation:
        opening, base = self._constrain(request)
        if opening:  # forced tool call: the opening is context the model continues from (mask 0)
            forced = self.renderer.encode(opening)
            plan = dataclasses.replace(
                plan, prompt_ids=joined_ids(plan.prompt_ids, forced), context_ids=plan.context_ids + forced
            )
        if len(plan.prompt_ids) >= self.max_model_len:
            raise ContextTooLong(
                f"this conversation is {len(plan.prompt_ids)} tokens but the context window of {self.model_name} "
                f"is {self.max_model_len} tokens (prompt and completion); shorten the messages"
            )
        # the request's own, or this call's of the rollout's (molt.types docstring)
        seed = request.params.seed
        if seed is None and self.defaults.seed is not None:
            seed = sub_seed(self.defaults.seed, self._count)
        self._count += 1
        ids = [f"{self.session_id}-{self._count}-{i}" for i in range(request.n)]
        # the role's LoRA adapter, where it has one (multiagent.adapters)
        base = base.copy(adapter=plan.role) if plan.role else base
        params = [base if seed is None else base.copy(seed=seed + i) for i in range(request.n)]
        self._inflight.update(ids)
        stream: dict[str, Any] = {}
        if plan.images:  # sources: the decoded images (vLLM processes them itself)
            stream = {
                "images": plan.images,
                "sources": [i.image for i in message_images(plan.messages or [])],
            }
        if listener is not None:
            listener.started(plan.prompt_ids)
            stream["on_tokens"] = listener.tokens
        try:
            completions = await asyncio.gather(
                *(
                    self.engine.generate(
                        plan.prompt_ids, p, session_id=self.session_id, request_id=rid, **stream
                    )
                    for p, rid in zip(params, ids)
                )
            )
        finally:
            self._inflight.difference_update(ids)
        if self.closed or any(c.finish_reason is FinishReason.ABORT for c in completions):
            raise SessionClosed(f"session {self.session_id} was closed while generating")
        choices = [self._choice(c, request, opening) for c in completions]
        actions = [
            Action(
                ch.action_ids,
                c.logprobs[: len(ch.action_ids)],
                c.versions[: len(ch.action_ids)],
                c.routed_experts,
            )
            for ch, c in zip(choices, completions)
        ]
        self.tracker.commit(plan, actions, [ch.message for ch in choices])
        return Generation(request.id, int(time.time()), plan.prompt_ids, choices)

    def _fits(self, *parts: Any) -> Any:
        """The first part, once the characters of every part (strings nested in lists and dicts) are within
        max_chars_per_token x the window: a cheap bound that refuses an oversized request before tokenizing it. A wire
        request whose body is within the limit is not walked (every character of its text took at least a byte of
        the body, up to the few a wire adds: a tool call's type), so a turn's check does not grow with its history."""

        def chars(x: Any) -> int:
            if isinstance(x, str):
                return len(x)
            if isinstance(x, dict):
                x = list(x.values())
            return sum(map(chars, x)) if isinstance(x, list) else 0

        n = chars(list(parts))
        if self.max_chars and n > self.max_chars:
            raise ContextTooLong(
                f"this conversation has {n} characters, more than the context window of {self.model_name} "
                f"({self.max_model_len} tokens) can hold at up to {self.max_chars / self.max_model_len:g} characters a "
                "token (max_chars_per_token); shorten the messages"
            )
        return parts[0]

    def _constrain(self, request: ChatRequest) -> tuple[str, SamplingParams]:
        """(the forced opening, the request's params with the grammar of its reply). A forced call (tool_choice
        "required" / "function") starts with the parser's call opening; `output` alone is a JSON reply; with
        tools that may be called, strict or grammar tools, a forced call or `output` make the reply a grammar of
        the parser's format (text or `output`, or calls; a forced call's rest). ValueError (400) for a choice that
        cannot be honoured, where the parser has no grammar or llguidance cannot compile it."""
        names = [t["function"]["name"] for t in request.tools or []]
        # the function forced: "" for any, None: no call forced
        name = {"function": request.tool_name, "required": ""}.get(request.tool_choice)
        opening = "" if name is None else call_opening(self.parser, name or None)
        build = getattr(self.parser, "grammar", None)
        why = None
        if name is not None and not names:
            why = "needs at least one tool in `tools`"
        elif name and name not in names:
            why = f"names the function {name!r}, which is not among the tools {names}"
        elif opening is None:
            why = "cannot be honoured: this server's tool parser cannot force a call"
        if why:
            raise ValueError(f"tool_choice {request.tool_choice!r} {why}")
        if not (request.parse_tools and (request.formats or request.output or opening and build)):
            if request.output is None:
                return opening, request.params
            return opening, request.params.copy(grammar=json_grammar(request.output))
        if build is None:
            raise ValueError(
                "strict or grammar tools and structured outputs beside tools need a grammar of the "
                "tool-call format, which this server's tool parser has none of"
            )
        tools = {n: request.formats.get(n, {"schema": {"type": "object"}}) for n in names}
        grammar = build(
            tools, name, request.output and json_lark(request.output), self._token, self.renderer.reasoning
        )
        return opening, request.params.copy(grammar=check_grammar(grammar, "tools"))

    def _token(self, marker: str) -> str | None:
        """A call marker as a Lark token; None where it is not one token (SmolLM2's `<tool_call>`): then the
        model writes it as text, in any tokenization, as the parser reads it."""
        ids = self.renderer.encode(marker)
        return f"<[{ids[0]}]>" if len(ids) == 1 else None

    def _choice(self, completion: Completion, request: ChatRequest, opening: str = "") -> Choice:
        ids = completion.token_ids
        finish = "length" if completion.finish_reason is FinishReason.LENGTH else "stop"
        cut, stop = self._find_stop(ids, request.stop) if request.stop else (len(ids), None)
        ids = ids[:cut]
        text = opening + self.renderer.reply_text(ids)
        if stop is not None:  # found in the generated part (a forced opening may contain it too)
            finish, text = "stop", text[: text.find(stop, len(opening))]
        tools = {
            t["function"]["name"]: {"schema": t["function"].get("parameters") or {}}
            for t in request.tools or []
        }
        parsed = (
            self.parser(text, tools={**tools, **request.formats}) if request.parse_tools else Parsed(text)
        )
        self.stats["malformed_tool_calls"] += parsed.malformed
        self.stats["tool_calls"] += len(parsed.calls)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.calls:
            finish, message["tool_calls"] = "tool_calls", parsed.calls
        tops = completion.top_logprobs[:cut] if completion.top_logprobs else None
        return Choice(
            ids, completion.logprobs[:cut], tops, parsed.content, parsed.calls, finish, stop, message
        )

    def _find_stop(self, ids: list[int], stops: list[str]) -> tuple[int, str | None]:
        """(number of tokens to keep, the stop string hit first) - the shortest prefix whose text holds a stop
        string, by binary search over prefixes (text only grows with more tokens)."""

        def first_stop(k: int) -> str | None:
            text = self.renderer.reply_text(ids[:k])
            found = [(text.find(s), s) for s in stops if s and s in text]
            return min(found)[1] if found else None

        if first_stop(len(ids)) is None:
            return len(ids), None
        cut = bisect_left(range(len(ids)), True, lo=1, key=lambda k: first_stop(k) is not None)
        return cut, first_stop(cut)

    def _check_open(self) -> None:
        if self.closed:
            raise SessionClosed(f"session {self.session_id} is closed")


def cache_key(wire: str, body: bytes, headers: Any) -> tuple[str, bool]:
    """(retry-cache key of a request, whether it may be answered from the cache): not when the client marks
    it as a first attempt."""
    return hashlib.sha256(wire.encode() + b"\0" + body).hexdigest(), headers.get(
        "x-stainless-retry-count"
    ) != "0"


def _put(cache: OrderedDict, key: str, value: Any, size: int) -> None:
    cache[key] = value
    while len(cache) > size:
        cache.popitem(last=False)
