"""`bench/engine.py --multi-turn` (its docstring says what it measures) and `bench/engine.py --cross-session`,
the prefix cache shared across sessions (molt.engine.prefix_cache):

- Second session: session A sends a `--prompt-tokens` prompt (one sampled token, so the time is its prefill),
  then a new session B the identical prompt; B's time over A's. Each round has a prompt of its own (A is cold).
- Group: `--group` requests sent together, one `--system-tokens` system prompt and each its own task of 8-40
  tokens (a harness's rollouts: one system prompt and tool list, a task each): the tokens the prefill forwards
  computed (rows x columns, a forward hook) against the group's prompt tokens, and the time against the same
  requests on an engine without the cache.
Rounds alternate the engines; the table has the median of `--repeats` rounds. The default model is a tiny Llama with
a 32K window (2 layers, hidden 256: vLLM's CPU attention refuses head_dim 16), `--model` another (SmolLM2:
8K window).

    .venv/bin/python bench/engine.py --cross-session [--model smollm2-135m-instruct --prompt-tokens 6000
        --system-tokens 4000] [--write]
    .venv-vllm/bin/python bench/engine.py --cross-session --engine vllm [--write]   # vLLM's, the same workload
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time

import torch

from molt.engine.hf import HFEngine
from molt.types import SamplingParams

ONE = SamplingParams(max_tokens=1, temperature=1.0, seed=0)


def tokens(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(10, vocab - 10, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def timed(*calls) -> float:
    start = time.perf_counter()
    await asyncio.gather(*calls)
    return time.perf_counter() - start


def prefill_counter(engine: HFEngine) -> list[int]:
    """Rows x columns of every prefill forward of `engine` (a decode step has one column), summed in [0]."""
    seen = [0]

    def count(_module, _args, kwargs):
        rows, columns = kwargs["input_ids"].shape
        seen[0] += rows * columns if columns > 1 else 0

    engine.model.register_forward_pre_hook(count, with_kwargs=True)
    return seen


async def measure(args, model_path: str, dtype: str) -> dict[str, list[float]]:
    if args.engine == "vllm":  # its automatic prefix caching, on and off (eager: a quick start-up)
        from molt.engine.vllm import VLLMEngine

        make = lambda cache: VLLMEngine(
            model_path, dtype=dtype, enable_prefix_caching=cache, enforce_eager=True
        )
    else:
        make = lambda cache: HFEngine(model_path, dtype=dtype, prefix_cache_mb=1024 if cache else 0)
    on, off = make(True), make(False)
    vocab, counted = on.vocab_size, prefill_counter(on) if args.engine == "hf" else [0]
    await on.generate([1, 2, 3], ONE)
    await off.generate([1, 2, 3], ONE)
    out: dict[str, list[float]] = {"first": [], "second": [], "cold group": [], "group": [], "tokens": []}
    for r in range(args.repeats):
        prompt = tokens(args.prompt_tokens, 1000 + r, vocab)
        out["first"].append(await timed(on.generate(prompt, ONE, f"a{r}")))
        out["second"].append(await timed(on.generate(prompt, ONE, f"b{r}")))
        system = tokens(args.system_tokens, 2000 + r, vocab)
        group = [
            system + tokens(8 + 32 * i // args.group, 3000 + 100 * r + i, vocab) for i in range(args.group)
        ]
        out["cold group"].append(await timed(*[off.generate(p, ONE) for p in group]))
        before = counted[0]
        out["group"].append(await timed(*[on.generate(p, ONE, f"g{r}-{i}") for i, p in enumerate(group)]))
        out["tokens"].append((counted[0] - before) / sum(map(len, group)))
    await on.close()
    await off.close()
    return out


def run_sessions(
    engine: HFEngine, starts: list[list[int]], user: list[int], turns: int, new: int, tag: str | None
) -> list[tuple[float, list]]:
    """One multi-turn run: per turn, (seconds until every session's reply is in, the completions). Sessions
    are keyed `tag-i` (None: no session id, the cache is not used)."""

    async def go() -> list[tuple[float, list]]:
        prompts, rows = [list(p) for p in starts], []
        for k in range(turns):
            params = SamplingParams(max_tokens=new, min_tokens=new, temperature=1.0)
            start = time.perf_counter()
            outs = await asyncio.gather(
                *[
                    engine.generate(p, params.copy(seed=k * 1000 + i), None if tag is None else f"{tag}-{i}")
                    for i, p in enumerate(prompts)
                ]
            )
            rows.append((time.perf_counter() - start, outs))
            prompts = [p + o.token_ids + user for p, o in zip(prompts, outs)]
        return rows

    return asyncio.run(go())


def multi_turn(engine: HFEngine, args, questions: list[str], where) -> tuple[str, str, str]:
    """`bench/engine.py --multi-turn` (its docstring); `where()`: the machine and its load, at the end."""
    n, history, user, turns, new = (
        args.sessions,
        args.history,
        args.user_tokens,
        args.turns,
        args.new_tokens or 32,
    )
    repeats, size = args.repeats or 2, history + 97 * n + user
    if args.device == "cpu":  # real text (any text: only the lengths matter for the time)
        stream = engine.tokenizer.encode(" ".join(questions) * (size // 200 + 1))[:size]
    else:
        stream = torch.randint(1000, 100_000, (size,)).tolist()
    starts = [stream[97 * i : 97 * i + history] for i in range(n)]  # a different window per session
    user_ids = stream[-user:]
    run_sessions(engine, [s[:64] for s in starts], user_ids[:16], 2, 4, "warm-up")
    times: dict[str, list[list[float]]] = {"off": [], "on": []}
    worst, same, replies = 0.0, 0, 0
    cache = engine.prefixes
    for r in range(repeats):
        cache.budget, budget = (
            0,
            cache.budget,
        )  # off: the cache is shared by every request, so it is turned off
        off = run_sessions(engine, starts, user_ids, turns, new, None)
        cache.budget = budget
        cache.refit()  # on: from an empty cache, as in the first round
        on = run_sessions(engine, starts, user_ids, turns, new, f"round{r}")
        times["off"].append([t for t, _ in off])
        times["on"].append([t for t, _ in on])
        for (_, a), (_, b) in zip(off, on):
            for x, y in zip(a, b):
                replies += 1
                if x.token_ids == y.token_ids:  # (bf16 roundings can flip a sample; then the values differ)
                    same += 1
                    worst = max(worst, max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)))
    lines = [
        "| turn | history tokens | new tokens | cache off s | cache on s | on / off |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for k in range(turns):
        off, on = (statistics.median(run[k] for run in times[m]) for m in ("off", "on"))
        length = history + k * (new + user)
        lines.append(
            f"| {k + 1} | {length} | {length if k == 0 else new + user} (+{new} sampled) | {off:.2f} | "
            f"{on:.2f} | {on / off:.2f}x |"
        )
    note = (
        f"{n} session(s) x {turns} turns: a {history}-token first prompt, each turn {new} sampled tokens "
        f"then a {user}-token message; median of {repeats} alternated rounds per turn. Replies with and "
        f"without the cache: {same} of {replies} the same tokens, their log-probs within {worst:.1e}; "
        f"{str(engine.model.dtype).removeprefix('torch.')}, {where()}."
    )
    return (
        "Multi-turn sessions with the prefix cache (`bench/engine.py --multi-turn`)",
        note,
        "\n".join(lines),
    )


def cross_session(args, model_path: str | None, where: str) -> tuple[str, str, str]:
    if model_path is None:
        from molt.testing.models import build_tiny_llama

        model_path = str(
            build_tiny_llama(tempfile.mkdtemp() + "/tiny-32k", hidden_size=256, max_positions=32768)
        )
    args.prompt_tokens = args.prompt_tokens or 16384
    args.system_tokens = args.system_tokens or 8192
    args.repeats = args.repeats or 3
    args.group = args.group if args.group > 1 else 8
    dtype = args.dtype or "float32"
    m = {k: statistics.median(v) for k, v in asyncio.run(measure(args, model_path, dtype)).items()}
    rows = [
        (
            f"a new session's identical {args.prompt_tokens}-token prompt (reference: the first session's)",
            "second",
            "first",
        ),
        (
            f"{args.group} rollouts, one {args.system_tokens}-token system prompt, a task each (reference: no cache)",
            "group",
            "cold group",
        ),
    ]
    lines = ["| workload | cache on s | reference s | ratio |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {what} | {m[a]:.3f} | {m[b]:.3f} | {m[a] / m[b]:.3f}x |" for what, a, b in rows]
    computed = (
        f"the group's prefill forwards computed {m['tokens']:.3f}x its prompt tokens (1/{args.group} = "
        f"{1 / args.group:.3f}: the system prompt once)"
        if args.engine == "hf"
        else "vLLM's automatic prefix caching on against off (vLLM's CPU build, eager)"
    )
    note = (
        f"One sampled token a request (the time is the prefill's), median of {args.repeats} rounds; {computed}. "
        f"{dtype}, {where}; the machine was shared with other engineers' tests: ratios, not absolute times, are "
        "what carries over."
    )
    engine = "vLLM's" if args.engine == "vllm" else "the embedded engine's"
    return (
        f"Prefix cache across sessions, {engine} (`bench/engine.py --cross-session`)",
        note,
        "\n".join(lines),
    )
