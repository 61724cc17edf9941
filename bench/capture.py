"""What the capture server costs: per-request latency through it against a direct engine call, and its
throughput with a zero-cost scripted engine.

    .venv/bin/python bench/capture.py [--model DIR] [--requests 6] [--max-tokens 16] [--append docs/benchmarks.md]

Latency: `c` concurrent sessions (c = 1 and 32) each send `--requests` single-turn chat requests in sequence,
every one generating exactly `--max-tokens` tokens (min_tokens = max_tokens, so both paths do the same work),
each after a seeded random think time of up to `--think` seconds, the same in both paths (independent agents
do not arrive in lockstep; without it the direct path's perfectly aligned arrivals batch better than any real
agents would, which measures the engine's scheduler, not the server).
"direct" awaits `engine.generate` on the same rendered prompt ids; "capture" posts the OpenAI request over
HTTP (one keep-alive httpx client per session, as each agent has its own SDK client) to a session of a
capture server in the same process and event loop, as agents run in a rollout worker. The engine runs in its
own process (`molt.engine.process`, the runtime's default; `--in-process` for a thread of this one). Direct and capture rounds alternate (the machine is shared) and the median over rounds
of the mean request latency is reported, plus the server's part of a capture request: its latency minus the
time the same request spent inside `engine.generate`. Throughput: a `ScriptedEngine` (no model work) behind the server in
its own process, 64 sessions each running multi-turn conversations over one keep-alive connection from a
light raw-socket client in this process; reported by the wall clock and per CPU-second of the server process
(the wall-clock figure depends on what else the machine runs; the CPU figure much less).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from molt.capture.render import ChatRenderer
from molt.capture.server import CaptureServer
from molt.types import SamplingParams


def _messages(worker: int, i: int) -> list[dict]:
    return [{"role": "user", "content": f"Question {i} from agent {worker}: what is {worker} + {i}?"}]


class _Timed:
    """Engine wrapper summing the seconds spent inside `generate`, to split capture latency into the engine's
    part and the server's (HTTP, rendering, recording, client)."""

    def __init__(self, engine):
        self.engine, self.seconds, self.calls = engine, 0.0, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return await self.engine.generate(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


async def _workers(concurrency: int, requests: int, think: float, one) -> list[float]:
    """Latencies of `requests` sequential calls of `one(worker, i)` per worker, each after a seeded random
    think time (the same in both paths), so independent agents do not arrive in lockstep."""

    async def worker(w: int) -> list[float]:
        rng, out = random.Random(w), []
        for i in range(requests):
            await asyncio.sleep(rng.uniform(0, think))
            t0 = time.perf_counter()
            await one(w, i)
            out.append(time.perf_counter() - t0)
        return out

    return [x for xs in await asyncio.gather(*(worker(w) for w in range(concurrency))) for x in xs]


async def _direct(engine, renderer, concurrency, requests, think, params) -> list[float]:
    async def one(w: int, i: int) -> None:
        ids = renderer.encode(renderer.render(_messages(w, i), None, add_generation_prompt=True))
        await engine.generate(ids, params)

    return await _workers(concurrency, requests, think, one)


async def _captured(server, concurrency, requests, think, params) -> list[float]:
    """Each session has its own keep-alive HTTP client, as each agent builds its own `AsyncOpenAI` (one shared
    client with a pool of 64 connections spends more time scanning its pool than the server spends on a
    request: httpx checks every pooled connection's socket per request)."""
    sessions = [await server.open_session(f"bench-{w}", params) for w in range(concurrency)]
    clients = [httpx.AsyncClient(timeout=600) for _ in sessions]

    async def one(w: int, i: int) -> None:
        s = sessions[w]
        r = await clients[w].post(
            f"{s.base_url}/chat/completions",
            headers={"Authorization": f"Bearer {s.api_key}"},
            json={"model": s.model_name, "messages": _messages(w, i)},
        )
        assert r.status_code == 200, r.text

    try:
        return await _workers(concurrency, requests, think, one)
    finally:
        for s, c in zip(sessions, clients):
            await c.aclose()
            await s.close()


async def latency(
    model: str, requests: int, max_tokens: int, rounds: int, think: float, in_process: bool = False
) -> list[dict]:
    from molt.engine.hf import HFEngine
    from molt.engine.process import EngineProcess

    engine = _Timed(
        HFEngine(model) if in_process else EngineProcess("molt.engine.hf:HFEngine", model, torch_threads=1)
    )
    renderer = ChatRenderer.from_pretrained(model)
    server = CaptureServer(engine, renderer)
    await server.start()
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens)
    rows = []
    await _direct(engine, renderer, 4, 1, 0.0, params)  # warm-up
    for concurrency in (1, 32):
        direct, captured, server_part = [], [], []
        for _ in range(rounds):
            direct.append(
                statistics.mean(await _direct(engine, renderer, concurrency, requests, think, params))
            )
            engine.seconds = engine.calls = 0
            latencies = await _captured(server, concurrency, requests, think, params)
            captured.append(statistics.mean(latencies))
            server_part.append(captured[-1] - engine.seconds / engine.calls)
        d, c, o = statistics.median(direct), statistics.median(captured), statistics.median(server_part)
        rows.append(
            {
                "sessions": concurrency,
                "direct_ms": d * 1e3,
                "capture_ms": c * 1e3,
                "added": (c - d) / d,
                "server_ms": o * 1e3,
                "server_share": o / c,
            }
        )
    await server.stop()
    await engine.close()
    return rows


def _serve_scripted(model: str, sessions: int, to_client, from_client) -> None:
    """Server process: a ScriptedEngine behind the capture server; answers "cpu" with its CPU seconds."""
    from transformers import AutoTokenizer

    from molt.testing.scripted import ScriptedEngine

    async def main() -> None:
        tokenizer = AutoTokenizer.from_pretrained(model)
        server = CaptureServer(ScriptedEngine(tokenizer, [REPLY]), ChatRenderer(tokenizer))
        await server.start()
        opened = [
            await server.open_session(f"bench-{i}", SamplingParams(max_tokens=32)) for i in range(sessions)
        ]
        to_client.put([(s.base_url, s.api_key) for s in opened])
        loop = asyncio.get_running_loop()
        while await loop.run_in_executor(None, from_client.get) == "cpu":
            to_client.put(time.process_time())
        await server.stop()

    asyncio.run(main())


REPLY = "The answer is 7."


async def _post(reader, writer, host: str, path: str, key: str, body: bytes) -> None:
    """One keep-alive HTTP/1.1 request on raw streams: a client far lighter than the server it measures."""
    writer.write(
        f"POST {path} HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {key}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    await reader.readexactly(length)


async def _load(targets: list[tuple[str, str]], rounds: int, turns: int) -> int:
    """Each target session runs `rounds` conversations of `turns` turns (the continuation path)."""

    async def worker(w: int, base_url: str, key: str) -> int:
        host, path = base_url.split("//")[1].split("/", 1)
        reader, writer = await asyncio.open_connection(*host.split(":"))
        for r in range(rounds):
            messages = []
            for t in range(turns):
                messages += _messages(w, r * turns + t)
                await _post(
                    reader,
                    writer,
                    host,
                    f"/{path}/chat/completions",
                    key,
                    json.dumps({"model": "scripted", "messages": messages}).encode(),
                )
                messages.append({"role": "assistant", "content": REPLY})
        writer.close()
        return rounds * turns

    return sum(await asyncio.gather(*(worker(w, url, key) for w, (url, key) in enumerate(targets))))


def throughput(model: str, sessions: int, rounds: int, turns: int = 4) -> tuple[float, float]:
    """(requests/s by the wall clock, requests per CPU-second of the server process)."""
    ctx = mp.get_context("spawn")
    to_client, from_client = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_serve_scripted, args=(model, sessions, to_client, from_client), daemon=True)
    proc.start()
    targets = to_client.get(timeout=120)
    asyncio.run(_load(targets, 1, turns))  # warm-up
    from_client.put("cpu")
    cpu0, t0 = to_client.get(), time.perf_counter()
    n = asyncio.run(_load(targets, rounds, turns))
    wall = time.perf_counter() - t0
    from_client.put("cpu")
    cpu = to_client.get() - cpu0
    from_client.put("stop")
    proc.join(timeout=30)
    return n / wall, n / cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint dir (default: a freshly built tiny Llama)")
    ap.add_argument("--requests", type=int, default=6, help="sequential requests per session per round")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--think", type=float, default=0.05, help="max random agent think time between requests (s)"
    )
    ap.add_argument(
        "--scripted-rounds", type=int, default=12, help="4-turn conversations per session (64 sessions)"
    )
    ap.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="sys.setswitchinterval for this process (the engine thread and the server share the GIL)",
    )
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="run the HF engine as a thread of this process (default: its own process, as workers do)",
    )
    ap.add_argument("--append", help="append the result table to this markdown file")
    args = ap.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    model = args.model
    if model is None:
        from molt.testing.models import build_tiny_llama

        model = str(build_tiny_llama(Path(tempfile.mkdtemp()) / "tiny-llama"))
    rows = asyncio.run(
        latency(model, args.requests, args.max_tokens, args.rounds, args.think, args.in_process)
    )
    rps, capacity = throughput(model, 64, args.scripted_rounds)
    header = (
        "| sessions | direct engine (ms/request) | through capture (ms/request) | added | server part of a "
        "capture request (ms) |"
    )
    lines = [header, "|---|---|---|---|---|"]
    lines += [
        f"| {r['sessions']} | {r['direct_ms']:.1f} | {r['capture_ms']:.1f} | {r['added']:+.1%} | "
        f"{r['server_ms']:.1f} ({r['server_share']:.1%}) |"
        for r in rows
    ]
    lines += [
        "",
        (
            f"Scripted engine (server cost alone), 64 sessions x {args.scripted_rounds} four-turn conversations "
            f"from another process: **{rps:.0f} requests/s** by the wall clock; **{capacity:.0f} requests per "
            f"CPU-second** of the server process (its capacity on one free core)."
        ),
    ]
    table = "\n".join(lines)
    print(table)
    if args.append:
        cmd = "python bench/capture.py" + "".join(
            f" {a}" for a in sys.argv[1:] if a != "--append" and a != args.append
        )
        with open(args.append, "a") as f:
            f.write(
                f"\n## Capture server overhead (`bench/capture.py`)\n\nCommand: `.venv/bin/{cmd}` on this 2-core "
                f"CPU machine (shared), tiny Llama, {args.max_tokens} tokens per request.\n\n{table}\n"
            )


if __name__ == "__main__":
    main()
