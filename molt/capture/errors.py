"""Errors and their wire shapes.

Every client mistake becomes a `WireError` with a 4xx status, an engine failure (`molt.engine.base.EngineError`)
one with a 5xx: 503 while the engine is gone (`EngineGone`: a rollout worker is starting a new one, so an SDK's
retry may succeed), 500 otherwise. Each is answered in the shape the client's SDK parses:
OpenAI `{"error": {"message", "type", "param", "code"}}`, Anthropic `{"type": "error", "error": {"type",
"message"}}` (on `/messages`). Request bodies are parsed here rather than by FastAPI, so malformed JSON and
schema mistakes are 400s with a readable message instead of FastAPI's 422.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import from_json

from molt.capture.session import ContextTooLong, SessionClosed
from molt.engine.base import EngineError, EngineGone
from molt.types import json_grammar

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
}

M = TypeVar("M", bound=BaseModel)


class WireError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        details: dict[str, Any] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.details = details  # Anthropic's machine-readable `error.details` (e.g. {"error_code": ...})

    def openai_body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        return {
            "type": "error",
            "error": {
                "type": _ANTHROPIC_TYPES.get(self.status, "api_error"),
                "message": self.message,
                **({"details": self.details} if self.details else {}),
            },
        }


def output_schema(fmt: Any, param: str) -> dict[str, Any] | None:
    """The JSON schema a structured-output request's reply is held to (`ChatRequest.output`, constrained
    decoding): a json_schema format's `schema` (Chat Completions nests it in `json_schema`), any object for
    json_object, None for text. `strict` needs nothing: the constraint is always strict. A 400 naming `param` for
    another type or a schema llguidance cannot compile."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    schema = None
    if kind == "json_object":
        schema = {"type": "object"}
    elif kind == "json_schema":
        schema = fmt.get("schema", (fmt.get("json_schema") or {}).get("schema"))
    try:
        if schema is None:
            raise ValueError(f"type {kind!r} is not one of text, json_object, json_schema (with a schema)")
        json_grammar(schema)
    except ValueError as e:
        raise WireError(400, f"{param}: {e}", code="invalid_request", param=param) from None
    return schema


ANSWERED = (SessionClosed, ValueError, EngineError)  # how a request may fail with a reply in the wire's shape


def error_reply(error: Exception) -> WireError:
    """The reply to a request that failed (one of ANSWERED): a closed session 404; a RenderError, ContextTooLong,
    RequestError (a ValueError) 400; an engine failure 500, 503 while the engine is gone."""
    if isinstance(error, EngineError):
        gone = isinstance(error, EngineGone)
        return WireError(
            503 if gone else 500, str(error), code="engine_unavailable" if gone else "engine_error"
        )
    if isinstance(error, SessionClosed):
        return WireError(404, str(error), code="session_closed")
    code = "context_length_exceeded" if isinstance(error, ContextTooLong) else "invalid_request"
    return WireError(400, str(error), code=code)


def parse_body(model: type[M], body: bytes) -> tuple[M, dict[str, Any]]:
    """(validated model, the parsed JSON) of a request body; WireError(400) naming the problem otherwise. The
    plain JSON is returned too because converting validated fields back to dicts costs more than reading them."""
    try:  # pydantic's Rust parser: half json.loads' time on a long conversation (the wire resends all of it)
        data = from_json(body)
    except ValueError as e:
        raise WireError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise WireError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data), data
    except ValidationError as e:
        problems = e.errors(include_url=False)
        where = ".".join(str(p) for p in problems[0]["loc"])
        text = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in problems[:3]
        )
        raise WireError(
            400, f"invalid request: {text}", code="invalid_request", param=where or None
        ) from None
