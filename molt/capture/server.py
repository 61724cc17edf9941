"""The capture server: one FastAPI app (served by uvicorn on 127.0.0.1) per rollout worker, many sessions.

Routes, per session `s/{session_id}`: POST `/v1/chat/completions` and `/v1/responses` (OpenAI), POST
`/v1/messages` and `/v1/messages/count_tokens` (Anthropic), GET `/v1/models`, GET/HEAD on the session URL itself
(harnesses probe their base URL; no key needed); and GET `/health`. Each session has its own random API key,
accepted as `Authorization: Bearer KEY` (OpenAI SDK) or `x-api-key: KEY` (Anthropic SDK).

A session opened without sampling parameters leaves `max_tokens` unset: a request that sends none may use the
rest of the context window, as OpenAI's API does (a run's rollouts set `rollout.max_new_tokens`).

Model names: any name a request gives is served by the one engine and echoed in the reply, as the reference
does, so an unchanged black-box agent that names its own model (`model="gpt-4o"`) works; `strict_model=True`
(`molt serve --strict-model`) answers a name other than the engine's (or `served_names`) with 400.

Errors: client mistakes are 4xx in the caller's wire shape (`errors.py`): malformed JSON, schema violations,
an unknown model name (strict only), a conversation the template rejects or that does not fit the window -> 400
(over `max_chars_per_token` characters a token of the window: refused before it is tokenized); a body over
`max_request_mb` -> 413; a wrong or missing key -> 401; an unknown or closed session -> 404. They never touch
other sessions. An engine failure is a 500 in the same shape, 503 while the engine is gone (being replaced).

`CaptureServer` implements `molt.agents.SessionProvider`; the runtime opens one session per rollout and closes
it when the rollout ends (which returns the segments).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import inspect
import secrets
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from molt.capture import anthropic_wire, openai_wire, responses_wire
from molt.capture.errors import ANSWERED, WireError, error_reply, parse_body
from molt.capture.render import ChatRenderer
from molt.capture.session import Session, cache_key
from molt.capture.streaming import LiveReply
from molt.capture.tools import choose_tool_parser
from molt.engine.base import Engine
from molt.types import SamplingParams

# FastAPI >= 0.165 records OpenTelemetry spans, metrics and logs for every request by default: work on the
# capture hot path that nobody reads (older releases have no such argument)
_NO_TELEMETRY = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters
    else {}
)


@functools.cache
def _freeze_heap() -> None:
    """Once per process, when the first server starts: the objects alive then (torch's, transformers', the
    tokenizer's: 405K in the long-session bench's process) move to the collector's permanent generation. A full
    collection walked them all, 175-185 ms of the capture process on the 2-core machine, at once and within a turn;
    the messages that turns keep (`Session._replies`) bring one on rarely (none in the bench's 100 turns, one among
    the last 10 of a 100-turn profiling run). Now it walks only what came later, and the young collections over
    the bench's 100 turns took 7 ms instead of 24 (docs/benchmarks.md). vLLM's server does the same at start-up
    (`vllm.utils.gc_utils.freeze_gc_heap`)."""
    gc.collect()
    gc.freeze()


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside our event loop: the host process owns signal handling."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class CaptureServer:
    def __init__(
        self,
        engine: Engine,
        renderer: ChatRenderer,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        tool_parser: str = "auto",
        served_names: tuple[str, ...] = (),
        strict_model: bool = False,
        max_request_mb: float = 32,
        max_chars_per_token: float = 16,
        roles: str = "",
    ):
        self.engine, self.renderer = engine, renderer
        # the agents' roles (multiagent.roles): a request names its own by its model field or a header
        self.roles = set(filter(None, roles.split(",")))
        self.host, self.port = host, port
        self.parser = choose_tool_parser(tool_parser, renderer.template, renderer.tokenizer)
        renderer.keep_special(self.parser.markers)  # type: ignore[attr-defined]
        # the names /v1/models lists (the only ones, if strict)
        self.model_names = {engine.model_name, *served_names, *self.roles}
        self.strict_model = strict_model
        self.max_request_mb, self.max_chars_per_token = max_request_mb, max_chars_per_token
        self.sessions: dict[str, Session] = {}
        self.app = FastAPI(
            title="molt capture", openapi_url=None, docs_url=None, redoc_url=None, **_NO_TELEMETRY
        )
        self.app.add_exception_handler(WireError, self._wire_error)
        # unknown routes, wrong methods
        self.app.add_exception_handler(StarletteHTTPException, self._http_error)
        self._routes()
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------------------------- lifecycle
    @property
    def url(self) -> str:
        wildcard = self.host in ("0.0.0.0", "::", "")  # a wildcard bind is not an address
        return f"http://{'127.0.0.1' if wildcard else self.host}:{self.port}"

    async def start(self) -> None:
        # agents pause between calls (tools, thinking) longer than uvicorn's 5 s default keep-alive; a
        # connection the server closes just as the client reuses it fails the request
        config = uvicorn.Config(
            self.app,
            host=self.host,
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
            timeout_keep_alive=300,
        )
        self._server = _EmbeddedServer(config)
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start (e.g. the port is taken)
                raise RuntimeError("the capture server stopped during start-up")
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        _freeze_heap()

    def request_stop(self) -> None:
        """Ask the server to stop (safe from a signal handler); `wait()` then returns."""
        if self._server is not None:
            self._server.should_exit = True

    async def wait(self) -> None:
        assert self._task is not None, "start() first"
        await self._task

    async def stop(self) -> None:
        for session in list(self.sessions.values()):
            await session.close()
        if self._task is not None:
            self.request_stop()
            await self._task

    # ------------------------------------------------------------------------------------- sessions
    async def open_session(
        self, rollout_id: str = "", sampling_params: SamplingParams | None = None
    ) -> Session:
        session_id = secrets.token_hex(8)
        session = Session(
            session_id=session_id,
            api_key=f"molt-{secrets.token_urlsafe(24)}",
            root_url=self.url,
            engine=self.engine,
            renderer=self.renderer,
            parser=self.parser,
            defaults=(sampling_params or SamplingParams(max_tokens=None)).copy(),
            rollout_id=rollout_id,
            max_chars_per_token=self.max_chars_per_token,
            on_close=lambda s: self.sessions.pop(s.session_id, None),
            subagent_role="subagent" if "subagent" in self.roles else "",
        )
        self.sessions[session_id] = session
        return session

    def session_for(self, session_id: str, request: Request) -> Session:
        """The session named in the path, if the request carries its key (404 / 401 otherwise). A path's
        "ID+ROLE" is session ID as agent ROLE sees it (`ChatContext.session`)."""
        session = self.sessions.get(session_id.partition("+")[0])
        if session is None:
            raise WireError(404, f"unknown or closed session {session_id!r}", code="session_not_found")
        key = request.headers.get("x-api-key") or ""
        auth = request.headers.get("authorization") or ""
        if auth[:7].lower() == "bearer ":
            key = key or auth[7:]
        if not secrets.compare_digest(key.encode(), session.api_key.encode()):
            raise WireError(401, "invalid API key for this session", code="invalid_api_key")
        return session

    # ------------------------------------------------------------------------------------- routes
    def _routes(self) -> None:
        app = self.app

        @app.get("/health")
        async def health() -> dict[str, Any]:
            return {"status": "ok", "model": self.engine.model_name, "sessions": len(self.sessions)}

        @app.get("/s/{session_id}/v1/models")
        async def models(session_id: str, request: Request) -> JSONResponse:
            self.session_for(session_id, request)
            return JSONResponse(
                {
                    "object": "list",
                    "data": [
                        {
                            "id": name,
                            "object": "model",
                            "created": 0,
                            "owned_by": "molt",
                            "type": "model",
                            "display_name": name,
                            "created_at": "1970-01-01T00:00:00Z",
                        }
                        for name in sorted(self.model_names)
                    ],
                }
            )

        # plain Starlette routes for the wires: no FastAPI dependency solving per request
        for path, wire in (
            ("chat/completions", openai_wire),
            ("messages", anthropic_wire),
            ("responses", responses_wire),
        ):
            handle = functools.partial(self._handle, wire=wire)
            app.add_route(f"/s/{{session_id}}/v1/{path}", handle, methods=["POST"])

        @app.post("/s/{session_id}/v1/messages/count_tokens")
        async def count_tokens(session_id: str, request: Request) -> JSONResponse:
            session = self.session_for(session_id, request)
            req, data = parse_body(anthropic_wire.SCHEMA, await self._body(request))
            try:
                return JSONResponse(anthropic_wire.count_tokens(req, data, session))
            except ValueError as e:
                raise error_reply(e) from None

        @app.api_route("/s/{session_id}", methods=["GET", "HEAD"])
        async def base(session_id: str) -> JSONResponse:
            if session_id.partition("+")[0] not in self.sessions:
                raise WireError(404, f"unknown or closed session {session_id!r}", code="session_not_found")
            return JSONResponse({"status": "ok", "model": self.engine.model_name})

    async def _handle(self, request: Request, wire: Any) -> Response:
        """Shared by the wires: a wire module has SCHEMA, to_chat, response_body and stream."""
        session = self.session_for(request.path_params["session_id"], request)
        raw = await self._body(request)
        req, data = parse_body(wire.SCHEMA, raw)
        if self.strict_model and req.model not in self.model_names:
            raise WireError(
                400,
                f"unknown model {req.model!r}; this server serves {sorted(self.model_names)}",
                code="model_not_found",
                param="model",
            )
        key, lookup = cache_key(wire.__name__, raw, request.headers)
        try:
            chat = wire.to_chat(req, data, session)  # ValueError: e.g. an image that cannot be decoded
            chat.body_bytes = len(raw)
            named = request.headers.get("x-molt-role") or request.path_params["session_id"].partition("+")[2]
            chat.role = self.role_of(req.model, named)
            if req.stream:  # tokens go out as they are sampled (streaming.py); errors before the first byte
                live = LiveReply(session, chat, key, lookup)
                await live.begin()
                # run after the stream, or once the client went away mid-stream: its engine request stops
                return StreamingResponse(
                    wire.stream(live, req, session),
                    media_type="text/event-stream",
                    background=BackgroundTask(live.cancel),
                )
            gen = await session.complete(chat, key, lookup)
        except ANSWERED as e:
            raise error_reply(e) from None
        return JSONResponse(wire.response_body(gen, req, session))

    def role_of(self, model: str | None, named: str) -> str:
        """A request's role: the one its header or session URL names (a declared role), else its model name if
        that is one, else none."""
        if named and named not in self.roles:
            raise WireError(
                400,
                f"role {named!r} (x-molt-role or the session URL) is not one of multiagent.roles "
                f"{sorted(self.roles)}",
            )
        return named or (model if model in self.roles else "")

    async def _body(self, request: Request) -> bytes:
        """The request's body, refused (413) over max_request_mb: by its declared length before it is read."""
        limit = int(self.max_request_mb * 2**20)
        declared = request.headers.get("content-length", "")
        too_large = WireError(
            413,
            f"the request body is over this server's limit of {self.max_request_mb:g} MB (max_request_mb)",
            code="request_too_large",
        )
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        raw = await request.body()
        if len(raw) > limit:
            raise too_large
        return raw

    @classmethod
    async def _http_error(cls, request: Request, error: StarletteHTTPException) -> JSONResponse:
        return await cls._wire_error(
            request,
            WireError(
                error.status_code, f"{request.method} {request.url.path}: {error.detail}", code="not_found"
            ),
        )

    @staticmethod
    async def _wire_error(request: Request, error: WireError) -> JSONResponse:
        anthropic = "/v1/messages" in request.url.path
        return JSONResponse(
            error.anthropic_body() if anthropic else error.openai_body(), status_code=error.status
        )
