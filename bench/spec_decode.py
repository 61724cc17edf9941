"""vLLM's ngram speculative decoding on a workload that repeats tool output (issue 33): speed, draft acceptance, and
whether the sampled tokens' log-probs stay the model's (the importance ratio's behaviour side), on vLLM's CPU build
(`make vllm`), SmolLM2-135M-Instruct in fp32.

Each of N concurrent requests is a chat whose user turn quotes a ~300-word tool result (a slice of this
repository's README) and asks for it back verbatim: the reply copies the prompt, which is what ngram
(prompt-lookup) drafting predicts. vLLM is driven directly (`vllm.LLM`, `logprobs_mode="processed_logprobs"`, as
Molt's engine sets it), because Molt's engine refuses `speculative_config` on the CPU build for what this bench
finds. One invocation is one engine (`--ngram K`: K speculative tokens, 0: none); it runs each temperature in
`--temperatures` on the same seeded requests and reports tokens/s, vLLM's draft/accept counters, the non-finite
log-probs, and the finite ones' gap to a transformers fp32 forward (log_softmax(logits / T)).

    .venv-vllm/bin/python bench/spec_decode.py [--ngram 0|4] [--requests 8] [--new-tokens 128] [--eager] [--write]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def copy_prompts(tokenizer, n: int) -> list[list[int]]:
    """Chats that quote a tool result and ask for it back verbatim (different README slices per request)."""
    words = (ROOT / "README.md").read_text().split()
    prompts = []
    for i in range(n):
        result = " ".join(words[i * 97 : i * 97 + 180])
        chat = [
            {"role": "system", "content": "You are a precise assistant."},
            {
                "role": "user",
                "content": f"Here is the output of the tool `read_file`:\n\n{result}\n\n"
                "Copy the tool output above exactly, word for word, with no comment.",
            },
        ]
        prompts.append(
            list(
                tokenizer.apply_chat_template(
                    chat, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
        )
    return prompts


def counters(llm) -> tuple[float, float]:
    """(drafted, accepted) tokens so far, vLLM's own counters (needs log stats on)."""
    names = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
    got = {m.name: m.value for m in llm.get_metrics() if m.name in names}
    return got.get(names[0], 0), got.get(names[1], 0)


@torch.no_grad()
def gaps(model, prompts, outs, temperature: float) -> torch.Tensor:
    """vLLM log-prob - log_softmax(logits / T) of a transformers fp32 forward, for every sampled token."""
    out = []
    for p, (tokens, logprobs) in zip(prompts, outs):
        logits = model(torch.tensor([p + tokens])).logits[0, len(p) - 1 : -1].double()
        ref = torch.log_softmax(logits / (temperature or 1.0), -1).gather(1, torch.tensor(tokens)[:, None])[
            :, 0
        ]
        out.append(torch.tensor(logprobs).double() - ref)
    return torch.cat(out)


def main(args) -> list[str]:
    import vllm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from molt.models import resolve_model

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    path = str(resolve_model("smollm2-135m-instruct"))
    prompts = copy_prompts(AutoTokenizer.from_pretrained(path), args.requests)
    spec = (
        {
            "speculative_config": {
                "method": "ngram",
                "num_speculative_tokens": args.ngram,
                "prompt_lookup_min": 2,
                "prompt_lookup_max": 5,
            }
        }
        if args.ngram
        else {}
    )
    start = time.perf_counter()
    llm = vllm.LLM(
        path,
        dtype="float32",
        max_model_len=2048,
        enforce_eager=args.eager,
        seed=0,
        logprobs_mode="processed_logprobs",
        disable_log_stats=False,
        enable_chunked_prefill=False,
        max_num_batched_tokens=8192,
        **spec,
    )
    startup, rows = time.perf_counter() - start, []
    for temperature in map(float, args.temperatures.split(",")):
        params = [
            vllm.SamplingParams(max_tokens=args.new_tokens, temperature=temperature, seed=i, logprobs=0)
            for i in range(len(prompts))
        ]
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params[:2], use_tqdm=False)  # warm-up
        before, t = counters(llm), time.perf_counter()
        done = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds, after = time.perf_counter() - t, counters(llm)
        outs = [
            (
                list(o.outputs[0].token_ids),
                [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
            )
            for o in done
        ]
        rows.append((temperature, seconds, outs, after[0] - before[0], after[1] - before[1]))
        print(f"  T={temperature}: {sum(len(o[0]) for o in outs) / seconds:.1f} tokens/s", flush=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    name = f"ngram, {args.ngram} tokens" if args.ngram else "no speculation"
    lines = [
        (
            "| engine | start-up, s | T | tokens | tokens/s | drafted / accepted | non-finite log-probs "
            "| gap of the finite ones, mean / max |"
        ),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for temperature, seconds, outs, drafted, took in rows:
        g = gaps(model, prompts, outs, temperature)
        finite = g[torch.isfinite(g)].abs()
        n = sum(len(o[0]) for o in outs)
        lines.append(
            f"| {name} | {startup:.0f} | {temperature:g} | {n} | {n / seconds:.1f} | {drafted:.0f} / "
            f"{took:.0f} | {len(g) - len(finite)} | {finite.mean():.2e} / {finite.max():.2e} |"
        )
    print("\n".join(lines))
    return lines


if __name__ == "__main__":  # vLLM spawns its engine core: the guard is required
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ngram", type=int, default=4, help="speculative tokens (0: no speculation)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", default="1,0")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no compilation: a faster start-up)")
    ap.add_argument("--write", action="store_true", help="append the table to docs/benchmarks.md")
    args = ap.parse_args()
    table = main(args)
    if args.write:
        with open(ROOT / "docs/benchmarks.md", "a") as f:
            f.write("\n" + "\n".join(table) + "\n")
