"""The embedded engine: throughput against padded `model.generate` (and, optionally, transformers'
continuous-batching manager), and multi-turn sessions with the session prefix cache on and off.

Throughput: N concurrent requests (default 16; `--group G`: G requests per prompt, as a GRPO group) of exactly
M new tokens (default 64; EOS is ignored through min_tokens / min_new_tokens) at temperature 1 with no
top-k/top-p, on SmolLM2-135M-Instruct in fp32.
Each variant runs once to warm up, then `--repeats` timed runs; the table reports the median and the best run.

Multi-turn (`--multi-turn`): `--sessions` concurrent sessions, each starting from a `--history`-token prompt and
running `--turns` turns; a turn samples `--new-tokens` tokens and the next prompt is the previous one plus that
reply plus `--user-tokens` tokens of a new message (an agent resending its whole history). "off" sends the same
requests with the cache turned off (a cold prefill), "on" starts each round from an empty cache. Rounds alternate
on/off (the cores are shared) and each turn's latency is the median over rounds; the seeded replies of both must be
the same tokens.

GPU (`--device cuda`, one command for the whole check): a random model of Qwen2.5-0.5B's shape in bf16,
throughput at 64 and 256 concurrent requests, then multi-turn with 64 sessions.

    .venv/bin/python bench/engine.py [--model PATH] [--continuous-batching] [--write]
    .venv/bin/python bench/engine.py --multi-turn [--history 1024] [--turns 6] [--user-tokens 256] [--write]
    .venv/bin/python bench/engine.py --device cuda [--write]
    .venv/bin/python bench/engine.py --tiny   # the --device cuda run's every step, on CPU, a tiny model
    .venv-vllm/bin/python bench/engine.py --engine vllm [--eager]   # vLLM beside this engine (engine_vllm.py)
    .venv/bin/python bench/engine.py --cross-session [--write]   # the prefix cache across sessions (engine_sessions.py)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from molt.engine.hf import HFEngine
from molt.models import resolve_model
from molt.types import SamplingParams

QUESTIONS = [
    "What is 3 + 4?",
    "Name a primary colour.",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "What is the capital of France?",
    "List three fruits.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "Describe a cat to someone who has never seen one, in detail, including its habits and its sounds.",
    "What is 12 times 7?",
    "Suggest a name for a pet goldfish.",
    "What does CPU stand for?",
    "Write one sentence about autumn leaves falling in a quiet park.",
    "Is a tomato a fruit or a vegetable?",
]


def prompts_for(tokenizer, n: int, device: str = "cpu") -> list[list[int]]:
    if device != "cpu":  # the random GPU model has no meaningful tokenizer: random ids, chat-sized
        gen = torch.Generator().manual_seed(0)
        return [
            torch.randint(
                1000, 100_000, (int(torch.randint(34, 52, (), generator=gen)),), generator=gen
            ).tolist()
            for _ in range(n)
        ]
    chats = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(n)]
    return [
        list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
        for c in chats
    ]


def run_engine(engine: HFEngine, prompts: list[list[int]], new: int) -> int:
    params = SamplingParams(max_tokens=new, min_tokens=new, temperature=1.0)

    async def go() -> int:
        outs = await asyncio.gather(*[engine.generate(p, params) for p in prompts])
        return sum(len(o.token_ids) for o in outs)

    return asyncio.run(go())


def run_clients(engine: HFEngine, prompts: list[list[int]], new: int, rounds: int = 3) -> int:
    """Requests arriving and leaving continuously: one client per prompt sends `rounds` requests back to back,
    each of a different length (new/2 to 3new/2 tokens), so rows leave and join at every few steps."""

    async def client(i: int) -> int:
        total = 0
        for k in range(rounds):
            n = new // 2 + (7 * i + 13 * k) % (new + 1)
            out = await engine.generate(
                prompts[(i + k) % len(prompts)], SamplingParams(max_tokens=n, min_tokens=n, temperature=1.0)
            )
            total += len(out.token_ids)
        return total

    async def go() -> int:
        return sum(await asyncio.gather(*(client(i) for i in range(len(prompts)))))

    return asyncio.run(go())


def run_generate(model, prompts: list[list[int]], new: int, pad_id: int) -> int:
    length = max(map(len, prompts))
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as for any decoder-only batch
        ids[i, length - len(p) :], mask[i, length - len(p) :] = torch.tensor(p), 1
    ids, mask = ids.to(model.device), mask.to(model.device)  # on CPU inputs, generate samples on the host
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=pad_id,
        )
    return (out.shape[1] - length) * len(prompts)


def start_continuous(model, new: int):
    """transformers' continuous-batching manager, started once (its start-up is not timed, as for the engine)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new, eos_token_id=-1
    )
    manager = model.init_continuous_batching(
        generation_config=config, continuous_batching_config=ContinuousBatchingConfig(return_logprobs=True)
    )
    manager.start()
    return manager


def run_continuous(manager, prompts: list[list[int]], new: int) -> int:
    ids = [manager.add_request(p, max_new_tokens=new, eos_token_id=-1) for p in prompts]  # -1: ignore EOS
    got = [manager.get_result(timeout=600) for _ in ids]
    assert all(g is not None and not g.error for g in got), "continuous batching failed"
    return sum(len(g.generated_tokens) for g in got)


def measure(variants: dict, repeats: int) -> dict[str, tuple[float, float]]:
    """Median and best tokens/s per variant. Rounds interleave the variants so that load from other
    processes on the shared cores hits them alike."""
    for fn in variants.values():
        fn()  # warm-up (allocator, kernels, thread pools)
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            tokens = fn()
            rates[name].append(tokens / (time.perf_counter() - start))
            print(f"  {name}: {rates[name][-1]:.1f} tokens/s", flush=True)  # a run cut short keeps these
    return {name: (statistics.median(r), max(r)) for name, r in rates.items()}


class Prefills:
    """Counts an engine's model forwards of more than one token per row (its prefills; on CUDA decode steps replay
    graphs and call no forward) and their host time, during the runs of `around`: what requests arriving
    continuously cost besides decoding."""

    def __init__(self, engine: HFEngine):
        self.engine, self.on, self.calls, self.seconds, self.runs = engine, False, 0, 0.0, 0
        forward = engine.model.forward

        def counted(*a, **kw):
            start = time.perf_counter()
            try:
                return forward(*a, **kw)
            finally:
                if self.on and kw["input_ids"].shape[1] > 1:
                    self.calls, self.seconds = self.calls + 1, self.seconds + time.perf_counter() - start

        engine.model.forward = counted

    def around(self, fn):
        def run():
            self.on, self.runs = self.runs > 0, self.runs + 1  # the first run is `measure`'s warm-up
            try:
                return fn()
            finally:
                self.on = False

        return run

    def close(self) -> str:
        del self.engine.model.forward  # the class's own again
        rounds = max(self.runs - 1, 1)
        return f"{self.calls / rounds:.0f} prefill forwards a round, {self.seconds / rounds:.2f} s of host in them"


def kernel_profile(engine: HFEngine, prompts: list[list[int]], new: int) -> None:
    """Print the kernels of one round (prefill and decode) by device time: which attention kernel runs, and how
    much of a step is attention against matmuls. Printed only (a diagnosis for the GPU session)."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.device.type == "cuda"
    with profile(
        activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
        experimental_config=_ExperimentalConfig(profile_all_threads=True),
    ) as prof:  # the engine's thread
        run_engine(engine, prompts, new)
    key = "device_time_total" if cuda else "self_cpu_time_total"
    graphs = "CUDA graphs" if engine.runner.graphs else "eager decode"
    print(
        f"Kernels of {len(prompts)} requests x {new} tokens, {graphs} (by {key}):\n"
        + prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=70),
        flush=True,
    )


def throughput(
    engine: HFEngine, prompts: list[list[int]], args: argparse.Namespace, stock, eager: HFEngine | None = None
) -> tuple[str, str, str]:
    """`stock`: the model as transformers loads it (the engine changes its own: attention and output head), for
    `generate` and transformers' continuous batching."""
    n, new, repeats, model = len(prompts), args.new_tokens or 64, args.repeats or (2 if eager else 3), stock
    variants = {
        "embedded engine (molt.engine.hf)": lambda: run_engine(engine, prompts, new),
        "padded model.generate": lambda: run_generate(model, prompts, new, engine.spec.pad_token_id),
    }
    if eager is not None:  # on CUDA: the same engine without CUDA graphs, and clients arriving continuously
        variants["embedded engine, eager decode"] = lambda: run_engine(eager, prompts, new)
        prefills = [Prefills(engine), Prefills(eager)]
        variants["clients arriving continuously (3 requests each)"] = prefills[0].around(
            lambda: run_clients(engine, prompts, new)
        )
        variants["the same, eager decode"] = prefills[1].around(lambda: run_clients(eager, prompts, new))
    manager = start_continuous(model, new) if args.continuous_batching else None
    if manager is not None:
        variants["transformers continuous batching"] = lambda: run_continuous(manager, prompts, new)
    rows = list(measure(variants, repeats).items())
    if manager is not None:
        manager.stop(block=True)
    base = rows[1][1][0]
    lines = [
        f"| variant | tokens/s (median of {repeats}) | best | vs padded generate |",
        "| --- | ---: | ---: | ---: |",
    ]
    lines += [f"| {name} | {med:.1f} | {best:.1f} | {med / base:.2f}x |" for name, (med, best) in rows]
    group = f", groups of {args.group} with one prompt" if args.group > 1 else ""
    context = (
        f"{n} requests x {new} new tokens{group}, prompt lengths {min(map(len, prompts))}-{max(map(len, prompts))}, "
        f"{str(engine.model.dtype).removeprefix('torch.')}, temperature 1, {_where(args)}"
    )
    if eager is not None:
        graphs, error = (
            engine.runner.graphs,
            engine.runner.graph_error,
        )  # the decoder: made at the first request
        context += (
            f"; CUDA graphs so far: {getattr(graphs, 'captures', 0)} captured in "
            f"{getattr(graphs, 'capture_s', 0.0):.1f} s (once per shape: batch and attended columns in "
            "powers of two)" + (f"; GRAPHS FAILED: {error}" if error else "")
        )
        context += (
            f"; clients arriving continuously: {prefills[0].close()} (graphs), {prefills[1].close()} "
            "(eager decode)"
        )
        for e in (engine, eager):  # graph replays, then eager decode steps: which attention kernels they run
            kernel_profile(e, prompts, min(new, 16))
    return "Embedded engine throughput (`bench/engine.py`)", context, "\n".join(lines)


def random_qwen_05b(dest: Path, tiny: bool = False, vocab: int = 151936) -> str:
    """A randomly initialised model of Qwen2.5-0.5B's shape (the speed of a forward pass does not depend on the
    weights), saved with molt.testing's small tokenizer (the GPU bench sends token ids); `tiny`: 2 layers of
    width 64, for the CPU rehearsal and `bench/engine_host.py` (which also shrinks the vocabulary)."""
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    from molt.testing.models import build_tokenizer

    width, layers, heads, mlp = (64, 2, 4, 128) if tiny else (896, 24, 14, 4864)
    config = Qwen2Config(
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        intermediate_size=mlp,
        vocab_size=vocab,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        rope_theta=1e6,
        eos_token_id=vocab - 291,
        pad_token_id=vocab - 293,
    )  # Qwen2.5's at 151,936
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=vocab - 291, pad_token_id=vocab - 293)
    model.save_pretrained(dest)
    build_tokenizer().save_pretrained(dest)
    return str(dest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--device", default="cpu", help="cpu, or cuda for the GPU check (random 0.5B-shaped model)"
    )
    ap.add_argument(
        "--model",
        default=None,
        help="checkpoint directory or alias (default: smollm2-135m-instruct; on cuda a random model)",
    )
    ap.add_argument(
        "--requests", default=None, help="concurrent requests, comma-separated (default: 16; cuda 64,256)"
    )
    ap.add_argument(
        "--new-tokens", type=int, default=None, help="tokens per request (default: 64; multi-turn 32)"
    )
    ap.add_argument(
        "--repeats", type=int, default=None, help="timed rounds (default: 3; cuda and multi-turn 2)"
    )
    ap.add_argument(
        "--group", type=int, default=1, help="requests per distinct prompt (a GRPO group; default 1)"
    )
    ap.add_argument("--continuous-batching", action="store_true", help="also time transformers' CB manager")
    ap.add_argument("--multi-turn", action="store_true", help="multi-turn sessions, prefix cache on and off")
    ap.add_argument(
        "--sessions", type=int, default=None, help="multi-turn: concurrent sessions (default 1; cuda 64)"
    )
    ap.add_argument("--history", type=int, default=1024, help="multi-turn: tokens of the first prompt")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--user-tokens", type=int, default=256, help="multi-turn: tokens of each new message")
    ap.add_argument(
        "--engine",
        choices=["hf", "vllm"],
        default="hf",
        help="vllm: vLLM's engine beside the embedded one, start-up included (bench/engine_vllm.py)",
    )
    ap.add_argument("--cross-session", action="store_true", help="the prefix cache across sessions")
    ap.add_argument(
        "--prompt-tokens", type=int, default=None, help="cross-session: its prompt (default 16384)"
    )
    ap.add_argument(
        "--system-tokens", type=int, default=None, help="cross-session: the group's (default 8192)"
    )
    ap.add_argument(
        "--dtype", default=None, help="the engine's (default: float32 on a CPU, bfloat16 on cuda)"
    )
    ap.add_argument("--eager", action="store_true", help="--engine vllm: enforce_eager (no compilation)")
    ap.add_argument("--write", action="store_true", help="append the result table to docs/benchmarks.md")
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="run --device cuda's steps on CPU with a tiny model, small counts (checks the bench itself "
        "before a GPU session; its numbers mean nothing)",
    )
    args = ap.parse_args()
    if args.tiny and (args.write or args.device != "cpu"):
        ap.error("--tiny runs on CPU and writes nothing")
    cuda = args.device != "cpu" or args.tiny
    if args.tiny:
        args.requests, args.sessions, args.history, args.turns = args.requests or "4,8", 4, 96, 3
        args.user_tokens, args.new_tokens, args.repeats = 16, args.new_tokens or 8, 1
    args.sessions = args.sessions or (64 if cuda else 1)
    torch.manual_seed(0)
    scratch = tempfile.TemporaryDirectory()
    model_path = (
        str(resolve_model(args.model or "smollm2-135m-instruct"))
        if args.model or not cuda
        else random_qwen_05b(Path(scratch.name), tiny=args.tiny)
    )
    args.model_name = (
        Path(model_path).name
        if args.model or not cuda
        else "random Qwen2.5 model, tiny (rehearsal)"
        if args.tiny
        else "random Qwen2.5-0.5B shape"
    )
    venv = ".venv-vllm" if args.engine == "vllm" else ".venv"
    cmd = f"{venv}/bin/python bench/engine.py " + " ".join(a for a in sys.argv[1:] if a != "--write")

    def report(title: str, context: str, table: str) -> None:
        """Print and append each table when it is done: a run cut short by a time limit keeps what it had."""
        print(f"{title}\n{context}\n\n{table}\n", flush=True)
        if args.write:
            with open(Path(__file__).resolve().parents[1] / "docs/benchmarks.md", "a") as f:
                f.write(f"\n## {title}\n\nCommand: `{cmd}`\n\n{context}\n\n{table}\n")

    import engine_sessions  # beside this file: multi-turn sessions and the prefix cache across sessions

    if args.cross_session:  # the tiny 32K Llama unless --model
        if not args.model:
            args.model_name = "tiny Llama (2 layers, hidden 256, 32K window)"
        return report(*engine_sessions.cross_session(args, model_path if args.model else None, _where(args)))
    if args.engine == "vllm":  # its own process layout: both engines in one event loop (bench/engine_vllm.py)
        import engine_vllm

        return engine_vllm.main(args, model_path, prompts_for, QUESTIONS, report)
    engine = HFEngine(
        model_path,
        max_batch_size=256 if cuda else 64,
        device=args.device,
        dtype=args.dtype or ("bfloat16" if cuda else "float32"),
        prefix_cache_mb=8192 if cuda else 1024,
    )
    eager = (
        HFEngine(model_path, max_batch_size=256, device=args.device, dtype="bfloat16", cuda_graphs=False)
        if cuda
        else None
    )
    from transformers import AutoModelForCausalLM

    stock = AutoModelForCausalLM.from_pretrained(model_path, dtype=engine.model.dtype).to(args.device).eval()

    if cuda or not args.multi_turn:
        for n in map(int, (args.requests or ("64,256" if cuda else "16")).split(",")):
            engine.scheduler.max_rows = engine.runner.max_batch_size = max(engine.scheduler.max_rows, n)
            prompts = prompts_for(engine.tokenizer, -(-n // args.group), args.device)
            # a GRPO group's samples share a prompt
            prompts = [p for p in prompts for _ in range(args.group)][:n]
            report(*throughput(engine, prompts, args, stock, eager))
    if eager is not None:
        asyncio.run(eager.close())
    if cuda or args.multi_turn:
        report(*engine_sessions.multi_turn(engine, args, QUESTIONS, lambda: _where(args)))
    asyncio.run(engine.close())


def _where(args: argparse.Namespace) -> str:
    device = (
        torch.cuda.get_device_name()
        if args.device != "cpu"
        else f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}"
    )
    return (
        f"{args.model_name}, torch {torch.__version__}, {device}, "
        f"1-min load average at the end {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
