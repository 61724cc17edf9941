"""An engine in a child process: `EngineProcess("molt.engine.hf:HFEngine", path, ...)` is an `Engine` whose model
runs in a spawned process, so the decode loop and the capture server (HTTP, rendering, the agents' coroutines) no
longer share one GIL. vLLM's `AsyncLLM` is built the same way (its EngineCore is a process); this gives the embedded
engine that property.

Why. With the engine as a thread of the rollout worker, every request's HTTP parsing, chat rendering and JSON
encoding competes with the decode loop's Python for the GIL; on the 2-core development machine this made requests
through the capture server much slower than direct engine calls at 32 concurrent sessions (docs/benchmarks.md). In a
process of its own the engine keeps a core while the server works on the other.

Wire. One `multiprocessing` pipe (spawn context). The parent sends ("generate", id, prompt, params, session),
("abort", id) and ("call", id, method, args); the child answers ("ok", id, result) or ("error", id, exception) from
its own event loop, where the real engine runs exactly as in-process. A reader thread in the parent resolves the
waiting futures. The prompt goes as the caller gave it: capture's int32 array pickles as its bytes (a list of 31K
ids took 0.34 ms to pickle and 0.5 ms to unpickle into as many objects; the array 0.006 ms each way), and the
child's engine makes its own list (`token_list`, 0.17 ms). Tensors sent with `update_weights` travel through shared
memory (torch registers its tensor reductions with multiprocessing's pickler), so a refit costs no pickle of the
bytes. A CPU engine goes further: its child moves the model's tensors into shared memory at start-up and hands them
to the parent (`shared_weights`), which copies a refit's tensors straight into them while the child is paused (one
copy; through the pipe each bucket was copied into a new shared segment, then again into the model: 0.65 s of
SmolLM2-135M's 1.2 s refit on the 2-core machine). The collective refit (`join_weight_group` / `receive_weights`) is
forwarded: the child joins the group. Its methods are `HFEngine`'s, each named (no `__getattr__` forwarding): one
client interface, in process or not. Streaming: a request with `on_tokens` gets ("tokens", id, ids) messages before
its answer.

Decisions: `torch_threads` sets the child's intra-op threads (a spawned process does not inherit the parent's
setting). The child is a daemon (it dies with its parent); if it exits, every waiting request and every later call
fails with `EngineGone` naming the exit code, and `exitcode` is that code before any of them fails (the rollout
worker then starts a new engine: `molt.runtime.worker`). `close()` closes the engine in the child, then the child
itself, which leaves with `os._exit` (the interpreter's teardown of torch took 1.7 s of every close). A rollout
worker starts the child first (`wait=False`) and waits for it (`started()`) after its own imports.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import multiprocessing as mp
import os
import sys
import threading
from collections.abc import Iterable
from typing import Any

from molt.engine.base import EngineError, EngineGone, copy_weights
from molt.types import Completion, SamplingParams


class EngineProcess:
    def __init__(
        self,
        factory: str,
        *args: Any,
        torch_threads: int = 0,
        start_timeout: float = 600.0,
        wait: bool = True,
        **kwargs: Any,
    ):
        """Spawn the child; `wait=False` returns at once and `started()` finishes the handshake later, so the
        caller's own imports and set-up overlap the child's (a rollout worker's start)."""
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_child_main,
            args=(child, factory, args, kwargs, torch_threads),
            daemon=True,
            name=f"molt-engine-{factory.rsplit(':', 1)[-1]}",
        )
        self._proc.start()
        child.close()
        self._start_timeout, self._ready = start_timeout, False
        self._ids = itertools.count()
        self._waiting: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future, Any]] = {}
        self._send_lock = threading.Lock()
        self._closed = False
        if wait:
            self.started()

    def started(self) -> None:
        """Wait until the child has built its engine (raises its start-up error); idempotent."""
        if self._ready:
            return
        import torch.multiprocessing  # noqa: F401 - registers shared-memory tensor pickling for the pipe

        try:
            if not self._conn.poll(self._start_timeout):
                raise EngineError(f"the engine process did not start within {self._start_timeout:.0f} s")
            kind, _, info = self._conn.recv()
        except EOFError:
            self._failed()
            raise EngineGone(
                f"the engine process died while starting (exit code {self._proc.exitcode})"
            ) from None
        except BaseException:
            self._failed(kill=True)
            raise
        if kind == "error":
            self._failed()
            raise info
        self.model_name: str = info["model_name"]
        self.max_model_len: int = info["max_model_len"]
        self.eos_token_ids: list[int] = info["eos_token_ids"]
        self.vocab_size: int = info["vocab_size"]
        self.weight_group_size: int = info["weight_group_size"]
        self._version: int = info["version"]
        self._shared: dict[str, Any] | None = info["shared"]  # a CPU model's weights in shared memory
        self._reader = threading.Thread(target=self._read, name="molt-engine-reader", daemon=True)
        self._reader.start()
        self._ready = True

    def _failed(self, kill: bool = False) -> None:
        """A start that did not succeed: the child gone, the pipe closed."""
        if kill:
            self._proc.kill()
        self._proc.join(timeout=10)
        self._conn.close()
        self._closed = True

    @property
    def version(self) -> int:
        return self._version

    @property
    def exitcode(self) -> int | None:
        """None while the child runs."""
        return self._proc.exitcode

    @property
    def num_requests(self) -> int:
        return len(self._waiting)

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        session_id: str | None = None,
        request_id: str | None = None,
        *,
        on_tokens: Any = None,
        images: Any = None,
        sources: Any = None,
    ) -> Completion:
        request_id = request_id or f"p{next(self._ids)}"
        try:
            return await self._request(
                "generate",
                request_id,
                prompt_ids,
                params,
                session_id,
                on_tokens is not None,
                images and (images, sources),
                on_tokens=on_tokens,
            )
        except asyncio.CancelledError:
            self._send(("abort", None, request_id))
            raise

    async def abort(self, request_id: str) -> None:
        self._send(("abort", None, request_id))

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        if self._shared is None:
            await self._call("update_weights", list(named_tensors), version)
        else:  # the child checks it is paused, takes the version and drops its caches; the bytes go in here
            await self._call("update_weights", [], version)
            await asyncio.to_thread(copy_weights, self._shared, named_tensors, self.model_name)
        self._version = version

    async def receive_weights(self, plan: list, version: int) -> None:
        await self._call("receive_weights", plan, version)
        self._version = version

    async def pause(self) -> None:
        await self._call("pause")

    async def resume(self) -> None:
        await self._call("resume")

    async def join_weight_group(self, address: str, rank: int, world: int) -> None:
        await self._call("join_weight_group", address, rank, world)

    async def weight_sums(self) -> dict[str, float]:
        return await self._call("weight_sums")

    async def prefix_stats(self) -> dict[str, int]:
        return await self._call("prefix_stats")

    async def close(self) -> None:
        if self._closed:
            return
        if not self._ready:  # never started: its owner's start-up failed first
            return await asyncio.to_thread(self._failed, True)
        try:
            if self._proc.is_alive():
                await asyncio.wait_for(self._call("close"), 60)
        finally:
            self._closed = True
            self._send(("exit", None, None))
            await asyncio.to_thread(self._proc.join, 30)
            if self._proc.is_alive():
                self._proc.kill()
            self._conn.close()

    # ---------------------------------------------------------------- parent side plumbing
    async def _call(self, method: str, *args: Any) -> Any:
        return await self._request("call", method, *args)

    async def _request(self, kind: str, *payload: Any, on_tokens: Any = None) -> Any:
        if self._closed:
            raise EngineGone("the engine is closed")
        loop = asyncio.get_running_loop()
        key = next(self._ids)
        future = loop.create_future()
        self._waiting[key] = (loop, future, on_tokens)
        try:
            self._send((kind, key, payload))
            return await future
        finally:
            self._waiting.pop(key, None)

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (BrokenPipeError, OSError) as e:
                if message[0] not in ("abort", "exit"):
                    raise self._gone_error() from e

    def _read(self) -> None:
        while True:
            try:
                kind, key, value = self._conn.recv()
            except (EOFError, OSError):
                break
            except Exception as e:  # noqa: BLE001 - a message that cannot be read: fail its waiters, go on
                error = EngineError(f"unreadable message from the engine process: {e!r}")
                for loop, future, _ in list(self._waiting.values()):
                    loop.call_soon_threadsafe(_settle, future, "error", error)
                continue
            entry = self._waiting.get(key)
            if entry is None:
                continue
            loop, future, on_tokens = entry
            if kind == "tokens":
                if on_tokens is not None:
                    loop.call_soon_threadsafe(on_tokens, value)
            else:
                loop.call_soon_threadsafe(_settle, future, kind, value)
        error = self._gone_error()
        for loop, future, _ in list(self._waiting.values()):
            loop.call_soon_threadsafe(_settle, future, "error", error)

    def _gone_error(self) -> EngineGone:
        """The error of a call the child can no longer answer, once its exit code is known: its end of the pipe
        closes a moment before it can be reaped, and the worker revives a dead engine by that code."""
        self._proc.join(10)
        if self._proc.exitcode is None:  # the pipe broke but the child lives on: it cannot serve anyone
            self._proc.kill()
            self._proc.join(10)
        return EngineGone(f"the engine process exited (exit code {self._proc.exitcode})")


def _settle(future: asyncio.Future, kind: str, value: Any) -> None:
    if not future.done():
        future.set_exception(value) if kind == "error" else future.set_result(value)


# -------------------------------------------------------------------- child side
def _child_main(conn: Any, factory: str, args: tuple, kwargs: dict, torch_threads: int) -> None:
    import signal

    import torch
    import torch.multiprocessing

    # a terminal's Ctrl-C reaches the whole group: the parent decides
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    if torch_threads:
        torch.set_num_threads(torch_threads)

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())  # not its default named semaphore, which os._exit below would leak
    asyncio.run(_serve(conn, factory, args, kwargs))
    # Nothing of the child outlives it (its shared-memory segments are unlinked at creation): skip the
    # interpreter's teardown of torch, which took 1.7 s of every close on the 2-core machine.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


async def _serve(conn: Any, factory: str, args: tuple, kwargs: dict) -> None:
    module, name = factory.split(":")
    try:
        engine = getattr(importlib.import_module(module), name)(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the parent re-raises it
        conn.send(("error", None, e if _picklable(e) else EngineError(repr(e))))
        return
    info = {
        "model_name": engine.model_name,
        "max_model_len": engine.max_model_len,
        "eos_token_ids": list(engine.eos_token_ids),
        "vocab_size": getattr(engine, "vocab_size", 0),
        "weight_group_size": getattr(engine, "weight_group_size", 1),
        "version": engine.version,
        "shared": engine.shared_weights() if hasattr(engine, "shared_weights") else None,
    }
    conn.send(("ok", None, info))
    loop = asyncio.get_running_loop()
    requests: dict[str, asyncio.Task] = {}

    def reply(kind: str, key: Any, value: Any) -> None:
        conn.send((kind, key, value if kind == "ok" or _picklable(value) else EngineError(repr(value))))

    async def run(key: Any, coro: Any) -> None:
        try:
            reply("ok", key, await coro)
        except Exception as e:  # noqa: BLE001 - every failure goes back to the waiting caller
            reply("error", key, e)

    while True:
        try:
            kind, key, payload = await loop.run_in_executor(None, conn.recv)
        except (EOFError, OSError):  # the parent died without closing us (e.g. its actor was killed)
            kind = "exit"
        if kind == "exit":
            break
        if kind == "generate":
            request_id, prompt, params, session_id, stream, images = payload
            on_tokens = (lambda ids, key=key: conn.send(("tokens", key, ids))) if stream else None
            # engines without images take no such argument
            extra = dict(zip(("images", "sources"), images or ()))
            coro = engine.generate(
                prompt, params, session_id, request_id=request_id, on_tokens=on_tokens, **extra
            )
            task = loop.create_task(run(key, coro))
            requests[request_id] = task
            task.add_done_callback(lambda _, rid=request_id: requests.pop(rid, None))
        elif kind == "abort":
            if payload in requests:
                await engine.abort(payload)
        elif kind == "call":
            method, *args = payload
            loop.create_task(run(key, getattr(engine, method)(*args)))


def _picklable(value: Any) -> bool:
    """Whether `value` survives the trip (an exception with a custom __init__ pickles but may not unpickle)."""
    import pickle

    try:
        pickle.loads(pickle.dumps(value))
        return True
    except Exception:  # noqa: BLE001
        return False
