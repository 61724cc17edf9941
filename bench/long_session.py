"""One long agent session through the capture server (issue 37): per-turn cost against history length, engine
memory, and the bytes a token costs in the payloads that travel through Ray.

    .venv/bin/python bench/long_session.py [--turns 100] [--window 32768] [--side-every 10] [--write docs/benchmarks.md]
        [--save DIR] [--train [CONFIG ...]]

A tiny Llama (`molt.testing.build_tiny_llama`, 2 layers, 64 hidden) with a `--window`-token context runs in its
own engine process (`molt.engine.process`, one torch thread, as rollout workers run it) behind a capture server in
this process. One session of `--turns` turns over HTTP (one keep-alive httpx client posting OpenAI chat requests
from a thread of its own; not the `openai` SDK, whose own client-side request transform walks the whole conversation in Python: about
360 ms per request at 38K tokens of history, more than the server's work): a ~800-token system prompt,
then each turn adds a user message of about `window / turns` tokens and samples `--max-tokens` tokens
(min_tokens = max_tokens, so every turn does the same decode work), growing to about the window. Every
`--side-every` turns the harness sends a side request on the same session, as Claude Code's title request does:
another system prompt over the same conversation, 8 tokens (the first prefills the whole history cold; later ones
can reuse the previous title's keys/values up to where the conversation went on).

Reported per history length (median of the `--near` main turns closest to 1K, 8K, 16K and 32K tokens): the
request latency seen by the client, the engine's part (time inside `engine.generate`) and capture's part (the
rest: client, HTTP, parsing, rendering, the continuation check, segment bookkeeping), and CPU times, which a
loaded machine's waits do not inflate: this process's (client and capture server; the engine has its own) over
the request, the client's (`time.thread_time` of its thread: encoding the conversation as JSON, sending it,
reading the reply: the harness's cost, not capture's) and the capture server's, the difference (its event loop,
the rendering thread, the engine pipe's reader: capture's own work per turn), and that less what the process
spends idle over the request's wall time (measured for 3 s before the session: uvicorn's 10 Hz tick and the event
loop's wake-ups, which a turn that waits longer for the engine would otherwise count as capture's work). Then the engine process's peak resident memory (which includes the cold prefill
of the last side request over the whole ~32K history) against the KV cache such a prompt needs, the prefix cache's reuse, and the payload of the session's experience as the
rollout worker offloads it: pickled bytes per token (`pickle` protocol 5, as Ray serializes it). Memory per
rollout: this process's resident memory (after `gc.collect()`) before the session, at its end with the session
still open (what the capture server holds for one live session, against the payload it becomes), and after the
session closed and its experiences were dropped; and the records the controller keeps once the payloads are
offloaded (pickled). `--train`: then the session's experiences through one training step per configuration
(`bench/long_session_train.py`: trainer peak RSS and step time).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import pickle
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.capture import _Timed
from molt.capture.render import ChatRenderer
from molt.capture.server import CaptureServer
from molt.types import Experience, SamplingParams, Trajectory

WORDS = [
    "the",
    "file",
    "path",
    "src",
    "main",
    "python",
    "error",
    "line",
    "test",
    "function",
    "return",
    "value",
    "list",
    "open",
    "read",
    "write",
    "class",
    "import",
    "module",
    "call",
    "result",
    "check",
    "fix",
    "bug",
]


def _text(rng: random.Random, renderer: ChatRenderer, tokens: int) -> str:
    """Random words cut to about `tokens` tokens of the model's tokenizer."""
    words = [rng.choice(WORDS) for _ in range(tokens)]
    return renderer.decode(renderer.encode(" ".join(words))[:tokens])


def _rss_peak(pid: int) -> tuple[float, float]:
    """(resident, peak resident) MiB of a process, from /proc (Linux)."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    return tuple(int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM"))


async def run(args: argparse.Namespace) -> dict:
    import httpx

    from molt.engine.process import EngineProcess
    from molt.testing.models import build_tiny_llama

    model = str(build_tiny_llama(Path(tempfile.mkdtemp()) / "tiny32k", max_positions=args.window))
    engine = _Timed(EngineProcess("molt.engine.hf:HFEngine", model, torch_threads=1))
    renderer = ChatRenderer.from_pretrained(model)
    server = CaptureServer(engine, renderer)
    await server.start()
    warm = await server.open_session("warm", SamplingParams(max_tokens=4))  # first-request costs, not counted
    async with httpx.AsyncClient(timeout=600) as c:
        await c.post(
            f"{warm.base_url}/chat/completions",
            headers={"Authorization": f"Bearer {warm.api_key}"},
            json={"model": warm.model_name, "messages": [{"role": "user", "content": "hi"}]},
        )
    await warm.close()
    loaded = _rss_peak(engine.engine._proc.pid)
    gc.collect()
    own_before = _rss_peak(os.getpid())[0]
    t0, cpu = time.perf_counter(), time.process_time()
    await asyncio.sleep(3)  # the server waiting: uvicorn's 10 Hz tick and the event loop's wake-ups
    idle = (time.process_time() - cpu) / (time.perf_counter() - t0)
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}  # the collector's, by generation, over the session
    started = [0.0]

    def collector(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses[info["generation"]].append(time.perf_counter() - started[0])

    gc.callbacks.append(collector)
    session = await server.open_session(
        "long", SamplingParams(max_tokens=args.max_tokens, min_tokens=args.max_tokens, seed=0)
    )
    client = httpx.Client(timeout=600, headers={"Authorization": f"Bearer {session.api_key}"})
    rng = random.Random(0)
    per_turn = (args.window - 2000) // args.turns - args.max_tokens - 10  # the template's ~10 tokens a turn
    messages = [{"role": "system", "content": "You are a coding agent. " + _text(rng, renderer, 800)}]
    turns, side = [], []

    def post(msgs: list[dict], max_tokens: int) -> tuple[dict, float]:
        """In the client's own thread: (the reply's JSON, the thread's CPU seconds for the request)."""
        cpu = time.thread_time()
        reply = client.post(
            f"{session.base_url}/chat/completions",
            json={
                "model": session.model_name,
                "messages": msgs,
                "max_tokens": max_tokens,
                "min_tokens": max_tokens,
            },
        )
        assert reply.status_code == 200, reply.text
        return reply.json(), time.thread_time() - cpu

    async def ask(msgs: list[dict], max_tokens: int) -> tuple[float, float, float, float, int, str]:
        engine.seconds = 0.0
        t0, cpu = time.perf_counter(), time.process_time()
        body, client_cpu = await asyncio.to_thread(post, msgs, max_tokens)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu
        return (
            wall,
            engine.seconds,
            cpu,
            client_cpu,
            body["usage"]["prompt_tokens"],
            body["choices"][0]["message"]["content"],
        )

    for t in range(args.turns):
        messages.append({"role": "user", "content": _text(rng, renderer, per_turn)})
        wall, in_engine, cpu, client_cpu, history, content = await ask(messages, args.max_tokens)
        turns.append(
            {
                "turn": t,
                "history": history,
                "wall": wall,
                "engine": in_engine,
                "cpu": cpu,
                "client_cpu": client_cpu,
                "after_side": bool(side) and side[-1]["turn"] == t - 1,
            }
        )
        messages.append({"role": "assistant", "content": content})
        if args.side_every and t % args.side_every == args.side_every - 1:
            title = [
                {"role": "system", "content": "Write a five-word title for this conversation."},
                *messages[1:],
            ]
            wall, in_engine, _, _, history, _ = await ask(title, 8)
            side.append({"turn": t, "history": history, "wall": wall, "engine": in_engine})
        if t % 10 == 9:
            last = turns[-1]
            print(
                f"turn {t + 1}: {last['history']} tokens, {last['wall'] * 1e3:.0f} ms "
                f"({last['engine'] * 1e3:.0f} in the engine)",
                flush=True,
            )
    gc.callbacks.remove(collector)
    stats = await engine.prefix_stats()
    peak = _rss_peak(engine.engine._proc.pid)
    gc.collect()
    own_live = _rss_peak(os.getpid())[0]  # the session still open: what capture holds for it
    segments = await session.close()
    trajectory = Trajectory("long", "long", segments, reward=1.0)
    experiences = [Experience.from_segment(trajectory, i) for i in range(len(segments))]
    tokens = sum(e.num_tokens for e in experiences)
    payloads = [e.split() for e in experiences]
    payload = sum(len(pickle.dumps(p, protocol=5)) for p in payloads)
    records = len(
        pickle.dumps(experiences, protocol=5)
    )  # what the controller keeps once payloads are offloaded
    for e, p in zip(experiences, payloads):  # back in place, for the training step
        for k, v in p.items():
            setattr(e, k, v)
    if args.save or args.train:
        from bench.long_session_train import save

        saved = save(Path(args.save or tempfile.mkdtemp()), model, experiences)
    n_segments = len(segments)
    del segments, trajectory, experiences, payloads
    gc.collect()
    own_after = _rss_peak(os.getpid())[0]
    client.close()
    await server.stop()
    await engine.close()
    return {
        "turns": turns,
        "side": side,
        "idle": idle,
        "pauses": pauses,
        "loaded": loaded,
        "peak": peak,
        "prefix": stats,
        "segments": n_segments,
        "tokens": tokens,
        "payload_bytes": payload,
        "records": records,
        "own": (own_before, own_live, own_after),
        "saved": saved if args.save or args.train else None,
        "kv_per_token": 2 * 2 * 2 * 16 * 4,
    }  # layers x (k, v) x kv heads x head dim x fp32


def table(result: dict, near: int) -> str:
    main = result["turns"]
    rows = [
        (
            "| history (tokens) | turns | request (ms) | engine (ms) | capture (ms) | CPU, client + server (ms) "
            "| client CPU (ms) | server CPU (ms) | server CPU less idle (ms) |"
        ),
        "|---:" * 9 + "|",
    ]
    servers = []
    for target in (1024, 8192, 16384, 32768):
        picked = sorted(main, key=lambda t: abs(t["history"] - target))[:near]
        wall, eng, cap, cpu, client, server, net = (
            statistics.median(f(t) * 1e3 for t in picked)
            for f in (
                lambda t: t["wall"],
                lambda t: t["engine"],
                lambda t: t["wall"] - t["engine"],
                lambda t: t["cpu"],
                lambda t: t["client_cpu"],
                lambda t: t["cpu"] - t["client_cpu"],
                lambda t: t["cpu"] - t["client_cpu"] - result["idle"] * t["wall"],
            )
        )
        servers.append(net)
        rows.append(
            f"| {statistics.median(t['history'] for t in picked):,.0f} | {min(t['turn'] for t in picked) + 1}"
            f"-{max(t['turn'] for t in picked) + 1} | {wall:.0f} | {eng:.0f} | {cap:.1f} | {cpu:.1f} | "
            f"{client:.1f} | {server:.1f} | {net:.1f} |"
        )
    every = [(t["cpu"] - t["client_cpu"] - result["idle"] * t["wall"]) * 1e3 for t in main[1:]]
    after = [t["engine"] * 1e3 for t in main if t["after_side"]]
    others = [t["engine"] * 1e3 for t in main[1:] if not t["after_side"]]
    side = [s["engine"] * 1e3 for s in result["side"]]
    loaded, peak, own = result["loaded"], result["peak"], result["own"]
    lines = [
        "",
        (
            f"Capture server's CPU per turn less idle, last row over first: {servers[-1] / servers[0]:.2f}x; over every main "
            f"turn but the first: mean {statistics.mean(every):.1f} ms, max {max(every):.1f} ms (turn "
            f"{every.index(max(every)) + 2}; the medians above "
            "leave out pauses such as the garbage collector's). Idle, the process spends "
            f'{result["idle"] * 1e3:.2f} ms of CPU a second (uvicorn\'s tick, the event loop): "less idle" takes '
            "that off each turn's server CPU pro rata of its wall time. The garbage collector over the session "
            "(this process): "
            + ", ".join(
                f"generation {g}: {len(p)} collections, {sum(p) * 1e3:.0f} ms"
                + (f" (longest {max(p) * 1e3:.0f} ms)" if p else "")
                for g, p in result["pauses"].items()
            )
            + "."
        ),
        (
            f"Side requests (a title under another system prompt): {len(side)}, engine median "
            f"{statistics.median(side):.0f} ms (each prefills the history since the previous title); the main turn "
            f"right after one: "
            f"engine median {statistics.median(after):.0f} ms, other turns {statistics.median(others):.0f} ms."
        )
        if side
        else "",
        (
            f"Prefix cache at the end: {result['prefix']['blocks']} blocks, {result['prefix']['bytes'] / 2**20:.1f} MiB, "
            f"{result['prefix']['reused_tokens']:,} prompt tokens reused over the session."
        ),
        (
            f"Engine process: {loaded[0]:.0f} MiB resident after loading, peak {peak[1]:.0f} MiB over the session "
            f"(+{peak[1] - loaded[1]:.0f} MiB; the KV cache of one {result['turns'][-1]['history']:,}-token prompt is "
            f"{result['kv_per_token'] * result['turns'][-1]['history'] / 2**20:.0f} MiB)."
        ),
        (
            f"Payload: {result['segments']} segment(s), {result['tokens']:,} tokens, {result['payload_bytes']:,} bytes "
            f"pickled = {result['payload_bytes'] / result['tokens']:.1f} bytes per token (int32 ids, a bool mask, "
            "float32 log-probs and int32 versions of the action tokens)."
        ),
        (
            f"Memory per rollout: the capture server's process (this one: server and client) grew by "
            f"{own[1] - own[0]:.0f} MiB from before the session to its end with the session still open "
            f"({own[0]:.0f} -> {own[1]:.0f} MiB resident; the payload pickles to {result['payload_bytes'] / 2**20:.2f} "
            f"MiB) and is {own[2]:.0f} MiB once the session is closed and its experiences dropped; the controller "
            f"keeps {result['records'] / result['segments']:.0f} bytes a segment once payloads are offloaded "
            f"(the records pickled, {result['records']:,} bytes for the {result['segments']} segments)."
        ),
    ]
    return "\n".join(rows + [line for line in lines if line])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=100)
    parser.add_argument("--window", type=int, default=32768)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--side-every", type=int, default=10)
    parser.add_argument("--near", type=int, default=5)
    parser.add_argument("--write", help="append the table to this markdown file")
    parser.add_argument(
        "--train",
        nargs="*",
        metavar="CONFIG",
        help="then one training step on the session's "
        "experiences per configuration (bench/long_session_train.py; none named: all)",
    )
    parser.add_argument(
        "--save",
        help="keep the model and the experiences in this directory (for bench/long_session_train.py --saved)",
    )
    args = parser.parse_args()
    t0 = time.perf_counter()
    result = asyncio.run(run(args))
    out = table(result, args.near)
    if args.train is not None:
        from bench.long_session_train import CONFIGS, measure
        from bench.long_session_train import table as train_table

        print(out, flush=True)
        out += "\n\n" + train_table(
            result["saved"], measure(result["saved"], args.train or list(CONFIGS), 8.0)
        )
    print(out, f"\n({time.perf_counter() - t0:.0f} s)")
    if args.write:
        command = "`.venv/bin/python bench/long_session.py " + " ".join(sys.argv[1:]) + "`"
        with open(args.write, "a") as f:
            f.write(
                f"\n## One long agent session (`bench/long_session.py`)\n\nCommand: {command}, "
                f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n{out}\n"
            )


if __name__ == "__main__":
    main()
