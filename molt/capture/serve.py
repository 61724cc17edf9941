"""`molt serve --model REF [--engine hf|vllm] [--host 127.0.0.1] [--port N] [--strict-model] [--prefix-cache-mb MB]
[--dtype auto|float32|bfloat16] [--allow-remote-images] [--max-request-mb MB] [--max-chars-per-token N] [--tool-parser NAME]`: the engine and capture server as a
standalone service, for debugging agents and for external harnesses. The engine's prefix cache
(`molt.engine.prefix_cache`) is shared by every session: an agent's next turn prefills only its new tokens, and a
new session only what no earlier one computed (a harness's system prompt once). Remote image URLs are refused unless allowed.

Routes added to the capture server's:
- POST /sessions (body optional: {"rollout_id": str, "sampling_params": {...}}; max_tokens left out: the rest of
  the window) -> {"session_id", "base_url", "session_url", "api_key"}. Unauthenticated: the service binds to loopback by default.
- GET /s/{session_id}/trajectory (the session's key) -> {"rollout_id", "reward", "segments": [{"token_ids",
  "action_mask", "behavior_logprobs", "versions" (one entry per token: 0.0 and -1 on context tokens),
  "break_reason", "temperature", "text", "images", "routed_experts"}]}: everything the segment records, `text`
  being the decoded segment with special tokens, `images` the sha256 of each image's bytes in order (the
  processor's inputs are not sent back), and `routed_experts` the MoE routes ([tokens][layers][k] expert ids) or
  null.
- POST /s/{session_id}/reward {"reward": float} (the session's key) sets the rollout's reward.
Sessions live until the service stops. It prints its address when ready and stops cleanly on SIGINT/SIGTERM.

`--engine vllm` serves with `molt.engine.vllm` (vLLM's own prefix cache: `--prefix-cache-mb 0` turns it off,
another size is refused, as vLLM sizes it from its KV cache).

This file and `doctor.py` are the CLI's wiring: they import `molt.models` and the engines inside the
functions, which the capture library itself never does.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from molt.capture.errors import WireError, parse_body
from molt.capture.render import message_images
from molt.capture.server import CaptureServer
from molt.types import SamplingParams, token_lists


class NewSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rollout_id: str = ""
    sampling_params: dict[str, Any] = Field(default_factory=dict)


class SetReward(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: float


def add_service_routes(server: CaptureServer) -> None:
    app = server.app

    @app.post("/sessions")
    async def new_session(request: Request) -> JSONResponse:
        raw = await request.body()
        spec = parse_body(NewSession, raw)[0] if raw.strip() else NewSession()
        try:
            params = SamplingParams.from_dict({"max_tokens": None, **spec.sampling_params}).validate()
        except (ValueError, TypeError) as e:
            raise WireError(400, f"sampling_params: {e}", param="sampling_params") from None
        session = await server.open_session(spec.rollout_id, params)
        return JSONResponse(
            {
                "session_id": session.session_id,
                "base_url": session.base_url,
                "session_url": session.session_url,
                "api_key": session.api_key,
            }
        )

    @app.get("/s/{session_id}/trajectory")
    async def trajectory(session_id: str, request: Request) -> JSONResponse:
        session = server.session_for(session_id, request)
        segments = [
            {
                **token_lists(s.token_ids, s.action_mask, s.behavior_logprobs, s.versions),
                "break_reason": s.break_reason,
                "temperature": s.temperature,
                "text": server.renderer.decode(s.token_ids.tolist()),
                "images": [str(ref) for ref in message_images(b.messages or [])],
                "routed_experts": None if s.routed_experts is None else s.routed_experts.tolist(),
            }
            for b in session.tracker.branches
            for s in [b.segment]
        ]
        return JSONResponse(
            {"rollout_id": session.rollout_id, "reward": session.reward, "segments": segments}
        )

    @app.post("/s/{session_id}/reward")
    async def reward(session_id: str, request: Request) -> JSONResponse:
        session = server.session_for(session_id, request)
        session.reward = parse_body(SetReward, await request.body())[0].reward
        return JSONResponse({"session_id": session_id, "reward": session.reward})


async def serve(
    model: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    engine: Any = None,
    engine_kind: str = "hf",
    ready: Any = print,
    allow_remote_images: bool = False,
    server_options: dict[str, Any] | None = None,
    engine_options: dict[str, Any] | None = None,
) -> None:
    """Run the service until SIGINT/SIGTERM. `engine` defaults to an HFEngine on `model` (a path) in a process
    of its own (`molt.engine.process`), leaving one core to the server, or with `engine_kind="vllm"` a VLLMEngine,
    built with `engine_options`; `server_options` are the `CaptureServer`'s (strict_model, max_request_mb,
    max_chars_per_token, tool_parser)."""
    from molt.capture.render import ChatRenderer

    engine_options = dict(engine_options or {})
    owned = engine is None
    if owned and engine_kind == "vllm":  # vLLM runs its engine core in a process of its own
        from molt.engine.vllm import VLLMEngine

        # vLLM's prefix cache lives in its KV cache, sized by VLLM_CPU_KVCACHE_SPACE or GPU memory
        cache_mb = engine_options.pop("prefix_cache_mb", None)
        if cache_mb:
            raise ValueError(
                "--prefix-cache-mb: vLLM sizes its prefix cache itself; only 0 (off) applies to it"
            )
        engine = VLLMEngine(model, enable_prefix_caching=cache_mb != 0, **engine_options)
    elif owned:
        from molt.engine.process import EngineProcess

        engine = EngineProcess(
            "molt.engine.hf:HFEngine",
            model,
            torch_threads=max(1, (os.cpu_count() or 2) - 1),
            **engine_options,
        )
    renderer = ChatRenderer.from_pretrained(model, allow_remote_images=allow_remote_images)
    server = CaptureServer(engine, renderer, host=host, port=port, **(server_options or {}))
    add_service_routes(server)
    await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, server.request_stop)
    ready(
        f"molt serve: {engine.model_name} on {server.url}  (POST {server.url}/sessions to open a session)",
        flush=True,
    )
    try:
        await server.wait()
        await server.stop()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if owned:
            await engine.close()


def serve_main(args: Any) -> int:
    """Entry point for `molt serve` (args: model, host, port and the command's options, absent or None: the
    default)."""
    from molt.models import resolve_model

    def given(*names: str) -> dict[str, Any]:
        return {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}

    asyncio.run(
        serve(
            str(resolve_model(args.model)),
            args.host,
            args.port,
            engine_kind=getattr(args, "engine", "hf"),
            allow_remote_images=getattr(args, "allow_remote_images", False),
            server_options=given("strict_model", "max_request_mb", "max_chars_per_token", "tool_parser"),
            engine_options=given("prefix_cache_mb", "dtype"),
        )
    )
    return 0
