"""Benchmark: chunked action log-probs (molt.trainer.logprobs) against a naive full-logits log-softmax.

Two scopes, each forward + backward of log-probs and entropy of every token of a B x L batch:
- head:  only the log-prob path, from the final hidden states [B, L, H] through the vocabulary projection
         (the part the chunking changes); hidden states are random, the projection is the model's.
- model: the whole causal LM (activation checkpointing on in both variants, so that the decoder's own
         activations are small and the comparison shows what the output path costs in a memory-lean step).

Peak memory is measured honestly for torch's CPU allocations: every variant runs in a fresh subprocess; before
each measured run the process's RSS high-water mark is reset (`/proc/self/clear_refs` = 5) and the reported peak
is VmHWM - VmRSS at the start of the run (so loading the model does not count); glibc's mmap threshold is
fixed at 128 KiB so that freed buffers leave the RSS. Time: a third process alternates the two variants
`--repeats` times after a warm-up and reports the fastest run of each, in CPU seconds of the process (the primary
number: this machine's 2 cores are shared, so wall time swings with other jobs) and in wall seconds.

    .venv/bin/python bench/trainer.py [--model PATH] [--batch 8] [--seq 256] [--scope head model] [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(key)


def _peak(fn, zero) -> float:
    """Peak bytes above the RSS at the start of one call of fn; gradients are freed (`zero`) before the start,
    so their allocation during backward counts in both variants."""
    zero()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = _status("VmRSS")
    fn()
    return _status("VmHWM") - start


def _steps(args) -> dict:
    """({"naive": fn, "chunked": fn}, zero): one forward + backward each on the same inputs, and a function
    that frees the gradients."""
    import torch
    from transformers import AutoModelForCausalLM

    from molt.trainer.batching import collate
    from molt.trainer.logprobs import CausalLMLogProbs, action_logprobs
    from molt.types import Experience

    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    b, length, vocab = args.batch, args.seq, lm.config.vocab_size
    ids = torch.randint(0, vocab, (b, length))
    mask = torch.ones(b, length, dtype=torch.bool)
    mask[:, 0] = False  # every token but the first is an action: no advantage from skipping prompts
    act_index, act_temp = mask.flatten().nonzero()[:, 0], torch.ones(int(mask.sum()))
    g = torch.randn(b, length)  # upstream per-token gradient, as a loss would give

    def naive_loss(logits):
        logp = torch.log_softmax(logits.float(), -1)[:, :-1]
        lp = logp.gather(-1, ids[:, 1:, None])[..., 0]
        ent = -(logp.exp() * logp).sum(-1)
        return ((lp + 0.01 * ent) * g[:, 1:]).sum()

    def chunked_loss(lp, ent):
        return ((lp + 0.01 * ent) * g).sum()

    if args.scope == "head":
        weight = lm.get_output_embeddings().weight.detach().clone().requires_grad_(True)
        del lm
        hidden = torch.randn(b, length, weight.shape[1], requires_grad=True)

        def zero():
            hidden.grad = weight.grad = None

        def run(variant):
            if variant == "naive":
                naive_loss(hidden @ weight.T).backward()
            else:
                chunked_loss(
                    *action_logprobs(
                        hidden,
                        weight,
                        None,
                        ids,
                        act_index,
                        act_temp,
                        chunk_size=args.chunk,
                        with_entropy=True,
                    )
                ).backward()
    else:
        lm.config.use_cache = False
        lm.gradient_checkpointing_enable({"use_reentrant": False})
        lm.train()
        wrapped = CausalLMLogProbs(lm, args.chunk)
        mb = collate(
            [
                Experience(
                    "r",
                    "g",
                    0,
                    0.0,
                    length,
                    length - 1,
                    0,
                    token_ids=row,
                    action_mask=[0] + [1] * (length - 1),
                    behavior_logprobs=[0.0] * length,
                    versions=[0] * length,
                )
                for row in ids.tolist()
            ],
            0,
            torch.device("cpu"),
            need_advantages=False,
        )

        def zero():
            lm.zero_grad(set_to_none=True)

        def run(variant):
            if variant == "naive":
                naive_loss(lm(input_ids=ids).logits).backward()
            else:
                chunked_loss(*wrapped(mb, True)).backward()

    return {v: (lambda v=v: run(v)) for v in ("naive", "chunked")}, zero


def worker(args) -> dict:
    """memory VARIANT: peak of one run after a warm-up, alone in this process. time: both variants
    alternated `repeats` times after a warm-up (so they share the machine's load), CPU and wall seconds."""
    steps, zero = _steps(args)
    if args.what != "time":
        steps[args.what]()  # warm-up
        return {"peak_mb": _peak(steps[args.what], zero) / 2**20}
    for fn in steps.values():
        zero()
        fn()
    out: dict = {f"{v}_{k}": [] for v in steps for k in ("cpu", "wall")}
    for _ in range(args.repeats):
        for v, fn in steps.items():
            zero()
            c0, w0 = time.process_time(), time.perf_counter()
            fn()
            out[f"{v}_cpu"].append(time.process_time() - c0)
            out[f"{v}_wall"].append(time.perf_counter() - w0)
    return {k: min(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model", default=None, help="HF checkpoint dir (default: resolve smollm2-135m-instruct)"
    )
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument(
        "--chunk", type=int, default=512, help="action rows per chunk (ActorConfig.logprob_chunk_size)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scope", nargs="+", default=["head", "model"], choices=["head", "model"])
    ap.add_argument("--write-docs", action="store_true", help="append the table to docs/benchmarks.md")
    ap.add_argument("--worker", nargs=2, metavar=("SCOPE", "WHAT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.scope, args.what = args.worker
        print(json.dumps(worker(args)))
        return
    if args.model is None:
        from molt.models import resolve_model

        args.model = str(resolve_model("smollm2-135m-instruct"))
    rows = []
    for scope in args.scope:
        res = {}
        for what in ("naive", "chunked", "time"):
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                scope,
                what,
                "--model",
                args.model,
                "--batch",
                str(args.batch),
                "--seq",
                str(args.seq),
                "--chunk",
                str(args.chunk),
                "--repeats",
                str(args.repeats),
            ]
            # A fixed mmap threshold turns off glibc's adaptive one, so every buffer of 128 KiB or more is mapped
            # on allocation and returned to the OS on free: RSS then follows live tensors instead of keeping
            # freed warm-up memory that a later allocation could reuse unseen. Timing runs use default malloc.
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"} if what != "time" else None
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT, env=env)
            res[what] = json.loads(out.stdout.strip().splitlines()[-1])
        n, c, t = res["naive"]["peak_mb"], res["chunked"]["peak_mb"], res["time"]
        rows.append(
            f"| {scope} | {n:.0f} | {c:.0f} | {c / n:.2f} | {t['naive_cpu']:.2f} | {t['chunked_cpu']:.2f} | "
            f"{t['chunked_cpu'] / t['naive_cpu'] - 1:+.1%} | {t['naive_wall']:.2f} | {t['chunked_wall']:.2f} |"
        )
    header = (
        "| scope | naive peak MiB | chunked peak MiB | peak ratio | naive CPU s | chunked CPU s | extra CPU time "
        "| naive wall s | chunked wall s |"
    )
    table = "\n".join([header, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", *rows])
    print(table)
    if args.write_docs:
        argv = " ".join(a for a in sys.argv[1:] if a != "--write-docs")
        section = (
            "\n## Trainer: chunked action log-probs vs a full-logits log-softmax\n\n"
            f"Command: `.venv/bin/python bench/trainer.py {argv}` (add `--write-docs` to append a new table here).\n\n"
            f"{Path(args.model).name} (vocabulary 49,152), {args.batch} x {args.seq} tokens, every token but the "
            f"first an action, forward + backward of log-probs and entropy, fp32, chunk {args.chunk}, this machine's "
            "CPU (2 cores shared with other jobs). `head` is the log-prob path alone (final hidden states -> "
            "vocabulary projection -> log-probs); `model` is the whole causal LM with activation checkpointing in "
            "both variants. Peak: RSS high-water above the start of one run (gradients freed before it, so their "
            "allocation counts), each variant in a fresh process. "
            "Time: fastest of alternated runs, CPU seconds of the process (wall seconds swing with the load of "
            "the shared cores). Goal: peak at most half of naive at no more than 10% extra time. "
            f"1-min load average at the end: {os.getloadavg()[0]:.1f}.\n\n{table}\n"
        )
        with open(ROOT / "docs" / "benchmarks.md", "a") as f:
            f.write(section)


if __name__ == "__main__":
    main()
