"""Long prompts in the embedded engine: prefill runs in chunks of a fixed token budget, attention never sees a
mask over the whole prompt (memory linear in its length), and the log-probs equal a plain unchunked forward."""

import asyncio

import pytest
import torch
import torch.nn.functional as F
from test_hf import load, recompute

from molt.engine.hf import HFEngine
from molt.testing.models import build_tiny_llama
from molt.types import SamplingParams


def long_prompt(n, salt=0):
    return [(7 * i + salt) % 300 + 10 for i in range(n)]


@pytest.fixture
def attention_queries(monkeypatch):
    """The query length of every masked attention call (an unmasked one is causal: no L x L tensor)."""
    seen, sdpa = [], F.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, *args, **kwargs):
        if attn_mask is not None:
            seen.append(query.shape[-2])
        return sdpa(query, key, value, attn_mask, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return seen


async def test_long_prompts_prefill_in_chunks_and_match_an_unchunked_forward(tmp_path, attention_queries):
    """A 3K-token prompt meeting a diverging cached prefix (a side request of its session) and two prompts of
    different lengths prefilled together (left padding): no attention mask has more query rows than the
    budget, and every log-prob equals a plain forward over the whole sequence."""
    path = build_tiny_llama(tmp_path / "m", max_positions=4096)
    engine = HFEngine(str(path), max_prefill_tokens=256)
    params = SamplingParams(max_tokens=4, min_tokens=4, temperature=1.0, seed=3)
    prompt = long_prompt(3000)
    await engine.generate(prompt[:40] + [3, 4], params, "s")  # the session's cache diverges after 40 tokens
    outs = [
        await engine.generate(prompt, params, "s"),
        *await asyncio.gather(
            engine.generate(long_prompt(2000, 1), params), engine.generate(long_prompt(1200, 2), params)
        ),
    ]
    await engine.close()
    assert (await engine.prefix_stats())["reused_tokens"] == 32  # the whole blocks of the 40 shared tokens
    assert attention_queries and max(attention_queries) <= 256
    model = load(path)
    for p, out in zip([prompt, long_prompt(2000, 1), long_prompt(1200, 2)], outs):
        _, expected = recompute(model, p, out, 1.0)
        assert torch.tensor(out.logprobs).sub(expected).abs().max() <= 1e-4


@pytest.mark.slow
async def test_a_32k_prompt_completes_on_a_32k_model_and_matches_an_unchunked_forward(tmp_path):
    """And the session's next turn, 300 new tokens over the cached 32K (the prefix cache's entry, the prefill's
    additive mask over the whole context, a contiguous row merged and stored without a gather), too."""
    path = build_tiny_llama(tmp_path / "m", max_positions=32768)
    engine = HFEngine(str(path))
    prompt = long_prompt(32000)
    params = SamplingParams(max_tokens=4, min_tokens=4, temperature=1.0, seed=1)
    out = await engine.generate(prompt, params, "s")
    turn = prompt + out.token_ids + long_prompt(300, 5)
    again = await engine.generate(turn, params, "s")
    await engine.close()
    assert (await engine.prefix_stats())[
        "reused_tokens"
    ] == 32000  # the whole blocks of all but the last sampled token
    model = load(path)
    for p, o in ((prompt, out), (turn, again)):
        _, expected = recompute(model, p, o, 1.0)
        assert torch.tensor(o.logprobs).sub(expected).abs().max() <= 1e-4


async def test_a_running_request_keeps_decoding_while_a_long_prompt_prefills_in_chunks(tiny_llama_dir):
    """Chunked prefill across steps: a 448-token prompt at a budget of 64 tokens per step takes 7 steps, and
    every step decodes the running request too, so it gains a token per chunk before the long one's first
    token (prefilled in one step, as before the split, it gained one or two). Ordered by the engine's own
    token callbacks, which reach the event loop in the order they were sampled."""
    engine = HFEngine(str(tiny_llama_dir), max_prefill_tokens=64)
    seen: list[str] = []
    try:
        running = asyncio.create_task(
            engine.generate(
                long_prompt(20),
                SamplingParams(max_tokens=60, min_tokens=60),
                on_tokens=lambda ids: seen.append("a"),
            )
        )
        while len(seen) < 3:
            await asyncio.sleep(0.001)
        before = len(seen)
        out = await engine.generate(
            long_prompt(448, 5),
            SamplingParams(max_tokens=2, min_tokens=2, seed=1),
            on_tokens=lambda ids: seen.append("b"),
        )
        assert seen.index("b") - before >= 6, seen
        await running
    finally:
        await engine.close()
    _, expected = recompute(load(tiny_llama_dir), long_prompt(448, 5), out, 1.0)
    assert torch.tensor(out.logprobs).sub(expected).abs().max() <= 1e-4
