"""The running batch's key/value slots (molt.engine.slots): bookkeeping checked value by value, and the padded
fixed-shape decode that CUDA captures, run eagerly on the CPU against the plain decode."""

import asyncio
import inspect

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from molt.engine.hf import HFEngine
from molt.engine.slots import GraphDecoder, Slots, grouped_attention, use_grouped_attention
from molt.types import SamplingParams


def group(mask: list[list[int]], base: int):
    """A prefilled group whose key at (row r, column c) is base + 10 r + c (values: the negation)."""
    m = torch.tensor(mask)
    keys = (base + 10 * torch.arange(len(mask))[:, None] + torch.arange(m.shape[1])[None]).float()
    keys = keys[:, None, :, None]
    return [(keys, -keys)], m


def tokens(slots: Slots, i: int) -> list[int]:
    ((k, v),) = slots.row(i)
    assert torch.equal(v, -k)
    return k.flatten().int().tolist()


def test_slots_merge_shift_keep_by_hand():
    slots = Slots(1, 1, 1, torch.float32, torch.device("cpu"), max_rows=8, max_columns=200)
    # row 0: a reused prefix (columns 1-2), a padding gap, then its suffix (column 4); row 1: five tokens
    slots.merge(*group([[0, 1, 1, 0, 1], [1, 1, 1, 1, 1]], 0))
    assert (slots.rows, slots.width) == (2, 5)
    assert tokens(slots, 0) == [1, 2, 4] and tokens(slots, 1) == [10, 11, 12, 13, 14]
    assert slots.mask[:2, :5].tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]  # the gap closed, right-aligned
    slots.merge(*group([[1] * 7], 100))  # longer: the running rows move right
    assert (slots.rows, slots.width) == (3, 7)
    assert [tokens(slots, i) for i in range(3)] == [[1, 2, 4], [10, 11, 12, 13, 14], list(range(100, 107))]
    positions = slots.advance()
    assert positions.flatten().tolist() == [3, 5, 7]
    new = torch.tensor([1000.0, 1001.0, 1002.0])[:, None, None, None]
    k, v = slots.view(3, 8, torch.tensor([7])).update(new, -new, 0)
    assert k.shape == (3, 1, 8, 1) and k[:, 0, 7, 0].tolist() == [1000, 1001, 1002]
    assert torch.equal(v, -k)
    slots.width += 1
    bias = slots.bias(3, 8, torch.float32)
    low = torch.finfo(torch.float32).min
    assert bias[:, 0, 0].tolist() == [[low] * 4 + [0.0] * 4, [low, low] + [0.0] * 6, [0.0] * 8]
    assert slots.keep([0, 2]) == [0, 2]  # nothing moves: row 2 takes the hole at slot 1
    assert (slots.rows, slots.width) == (2, 8)
    assert tokens(slots, 0) == [1, 2, 4, 1000] and tokens(slots, 1) == list(range(100, 107)) + [1002]
    moved = slots.moved
    slots.merge(
        *group([[1] * 100], 200)
    )  # beyond the 64 columns reserved so far: storage grows, content kept
    assert slots.moved == moved + 1 and slots.mask.shape[1] == 128 and (slots.rows, slots.width) == (3, 100)
    assert slots.keep([2, 0]) == [0, 2]  # the 100-token row's slot stays
    assert tokens(slots, 1) == list(range(200, 300)) and tokens(slots, 0) == [1, 2, 4, 1000]
    assert slots.keep([1]) == [1]  # it moves into slot 0; the short row was the last, no trim (same bucket)
    assert (slots.rows, slots.width) == (1, 100) and tokens(slots, 0) == list(range(200, 300))
    slots.merge(*group([[1] * 3], 400))
    assert slots.keep([1]) == [1] and tokens(slots, 0) == [400, 401, 402]
    assert slots.width == 3  # 3 columns fit a smaller power of two than 100: the leading 97 went
    assert slots.mask[0, :8].tolist() == [1, 1, 1, 0, 0, 0, 0, 0] and not slots.mask[1:].any()
    with pytest.raises(RuntimeError, match="exceeds"):
        slots.reserve(9, 10)


PROMPTS = [[3 + i] + list(range(20, 20 + 12 * i)) for i in range(7)]  # up to 73 tokens: the slots grow


async def run(engine: HFEngine, prompts: list[list[int]]) -> list:
    """Seeded requests of different lengths arriving while others decode and leaving at different steps, then a
    second turn of two sessions (prefix reuse into the running batch)."""

    async def one(i: int, prompt: list[int], delay: float, session: str | None = None):
        await asyncio.sleep(delay)
        params = SamplingParams(max_tokens=4 + 3 * (i % 4), temperature=1.0, seed=i)
        return await engine.generate(prompt, params, session_id=session or f"s{i}")

    first = await asyncio.gather(*(one(i, p, 0.01 * (i % 3)) for i, p in enumerate(prompts)))
    turns = [prompts[i] + first[i].token_ids + [7, 8, 9] for i in (0, 3)]
    second = await asyncio.gather(*(one(10 + i, t, 0.0, f"s{i * 3}") for i, t in enumerate(turns)))
    return first + second


def test_padded_decode_equals_plain_decode(tiny_llama_dir):
    """Synchronous (asyncio.run): the GPU image runs these tests without pytest-asyncio."""
    plain, padded = HFEngine(str(tiny_llama_dir)), HFEngine(str(tiny_llama_dir))
    padded.runner.graphs, padded.scheduler.hold_steps = (
        True,
        8,
    )  # the CUDA path without capture (molt.engine.slots)
    try:
        want, got = asyncio.run(run(plain, PROMPTS)), asyncio.run(run(padded, PROMPTS))
        stats = asyncio.run(padded.prefix_stats())
    finally:
        asyncio.run(plain.close())
        asyncio.run(padded.close())
    assert isinstance(padded.runner.graphs, GraphDecoder) and padded.runner.graphs.captures == 0
    assert not isinstance(plain.runner.graphs, GraphDecoder)
    assert stats["reused_tokens"] > 0
    same(want, got)


def test_a_failed_capture_falls_back_to_eager_decode(tiny_llama_dir, monkeypatch):
    def fail(self, ids, positions):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(GraphDecoder, "__call__", fail)
    plain, broken = HFEngine(str(tiny_llama_dir)), HFEngine(str(tiny_llama_dir))
    broken.runner.graphs = True
    try:
        want = asyncio.run(run(plain, PROMPTS))
        with pytest.warns(UserWarning, match="decoding eagerly: operation not permitted"):
            got = asyncio.run(run(broken, PROMPTS))
    finally:
        asyncio.run(plain.close())
        asyncio.run(broken.close())
    same(want, got)
    assert broken.runner.graphs is False and "not permitted" in broken.runner.graph_error


def same(want: list, got: list, version: int = 0) -> None:
    for a, b in zip(want, got):
        assert (
            a.token_ids == b.token_ids and a.finish_reason == b.finish_reason and set(b.versions) == {version}
        )
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_equal_eager_decode_and_survive_a_refit(tiny_llama_dir):
    asyncio.run(_graphs_equal_eager_decode_and_survive_a_refit(tiny_llama_dir))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_bf16_engine_head_returns_unrounded_fp32_logits(tiny_llama_dir):
    """A bf16 engine's output head keeps its fp32 accumulator, as the trainer's log-prob head does: much closer
    to an fp64 reference than the same logits rounded to bf16 (`molt.engine.slots.fp32_logits`)."""
    engine = HFEngine(str(tiny_llama_dir), device="cuda", dtype="bfloat16")
    try:
        head = engine.model.get_output_embeddings()
        x = 4 * torch.randn(64, head.weight.shape[1], device="cuda", dtype=torch.bfloat16)
        got, exact = head(x), x.double() @ head.weight.double().T
        assert got.dtype == torch.float32
        assert (got - exact).abs().max() < 0.25 * ((x @ head.weight.T).float() - exact).abs().max()
    finally:
        asyncio.run(engine.close())


async def _graphs_equal_eager_decode_and_survive_a_refit(tiny_llama_dir):
    """fp32 on CUDA: graph replays give the eager engine's tokens and log-probs, before and after a refit, and
    the refit keeps every captured graph (capture is paid once per shape, not per refit)."""
    graphs, eager = (
        HFEngine(str(tiny_llama_dir), device="cuda"),
        HFEngine(str(tiny_llama_dir), device="cuda", cuda_graphs=False),
    )
    try:
        same(await run(eager, PROMPTS), await run(graphs, PROMPTS))
        # the most this workload can need (7 rows, under 128 columns): the storage cannot grow (and drop its
        # graphs) later, whichever requests happen to overlap on a fast GPU; then capture on that storage
        graphs.runner.slots.reserve(len(PROMPTS), 128)
        same(await run(eager, PROMPTS), await run(graphs, PROMPTS))
        decoder = graphs.runner.graphs
        assert isinstance(decoder, GraphDecoder) and decoder.graphs and graphs.runner.graph_error is None
        before, captures, moved = dict(decoder.graphs), decoder.captures, graphs.runner.slots.moved
        new = {k: v + 0.02 * torch.randn_like(v) for k, v in graphs.model.state_dict().items()}
        for engine in (graphs, eager):
            await engine.pause()
            await engine.update_weights(new.items(), 1)
            await engine.resume()
        same(await run(eager, PROMPTS), await run(graphs, PROMPTS), version=1)
        assert graphs.runner.slots.moved == moved and all(
            decoder.graphs.get(key) is graph for key, graph in before.items()
        )
        assert decoder.captures - captures == len(decoder.graphs) - len(
            before
        )  # only new shapes were captured
    finally:
        await graphs.close()
        await eager.close()


class HostTensors(TorchDispatchMode):
    """Counts ops that take a host tensor (a copy to the device each replay would skip)."""

    def __init__(self):
        super().__init__()
        self.host = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in tree_leaves((args, kwargs))):
            self.host.append(func)
        return func(*args, **(kwargs or {}))


def meta_decode(config) -> tuple[torch.Tensor, list]:
    """One decode step of GraphDecoder on the meta device: tensors without data, so any op that reads a value
    (`.item()`, `nonzero`, a Python `if` on a tensor: what a CUDA capture refuses) raises."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config).eval()
    use_grouped_attention(model)  # as the engine does
    dim = config.hidden_size // config.num_attention_heads
    slots = Slots(
        config.num_hidden_layers,
        config.num_key_value_heads,
        dim,
        torch.float32,
        torch.device("meta"),
        64,
        4096,
    )
    slots.reserve(4, 128)
    slots.rows, slots.width = 3, 70  # 3 running rows; the step attends 128 columns
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    decoder, ids = (
        GraphDecoder(model, slots, cache_kw, capture=False),
        torch.zeros(3, 1, dtype=torch.long, device="meta"),
    )
    with torch.no_grad(), HostTensors() as probe:
        logits = decoder(ids, ids)
    return logits, probe.host


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_decode_step_reads_no_device_value_and_takes_no_host_tensor(family):
    """What makes the step capturable as a CUDA graph, checked without a GPU: on the meta device it runs through
    with no host tensor (Llama, and Qwen2: the GPU bench's 0.5B shape, scaled down); dynamic RoPE, which reads
    the largest position, does not run through (the probe can fail)."""
    from transformers import AutoConfig

    small = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 300,
    }
    logits, host = meta_decode(AutoConfig.for_model(family, **small))
    assert logits.shape == (3, 300) and host == []
    dynamic = AutoConfig.for_model(
        family, **small, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    )
    with pytest.raises(RuntimeError, match="item.. cannot be called on meta tensors"):
        meta_decode(dynamic)


def test_grouped_decode_attention_equals_transformers_sdpa(tiny_llama_dir, monkeypatch):
    """One query per row against a padded cache: the same output as transformers' sdpa (which repeats each
    key/value head per query head). The engine's decode steps take that path (a spy counts them); a model whose
    own code asks for the name "sdpa" (Falcon) keeps sdpa."""
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from molt.engine import slots

    torch.manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)
    query, key, value = (
        torch.randn(4, 1, 6, 8).transpose(1, 2),
        torch.randn(4, 2, 9, 8),
        torch.randn(4, 2, 9, 8),
    )
    mask = torch.zeros(4, 1, 1, 9).masked_fill_(torch.rand(4, 1, 1, 9) < 0.3, -1e30)
    mask[..., -1] = 0  # every query sees its own position
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    got, _ = grouped_attention(module, query, key, value, mask, scaling=0.3)
    assert got.shape == want.shape == (4, 1, 6, 8)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)

    calls = []
    spy = SimpleNamespace(
        scaled_dot_product_attention=lambda q, *a, **kw: (
            calls.append(q.shape) or torch.nn.functional.scaled_dot_product_attention(q, *a, **kw)
        )
    )
    monkeypatch.setattr(slots, "F", spy)
    engine = HFEngine(str(tiny_llama_dir))
    try:
        assert engine.model.config._attn_implementation == "molt_sdpa"
        out = asyncio.run(
            engine.generate([5, 6, 7], SamplingParams(max_tokens=4, min_tokens=4, temperature=0))
        )
    finally:
        asyncio.run(engine.close())
    layers, heads = engine.model.config.num_hidden_layers, engine.model.config.num_key_value_heads
    assert len(out.token_ids) == 4 and len(calls) == 3 * layers  # every decode step after the prefill's token
    assert all(shape[1:3] == (heads, 2) for shape in calls)  # 4 query heads as 2 queries of each of 2 heads
    falcon = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(
            "falcon", hidden_size=32, num_hidden_layers=1, num_attention_heads=4, vocab_size=64
        ),
        attn_implementation="sdpa",
    )
    assert not use_grouped_attention(falcon) and falcon.config._attn_implementation == "sdpa"


def test_dynamic_rope_models_decode_without_graphs(tiny_llama_dir):
    """Dynamic RoPE syncs the host inside the forward (a Python `if` on the largest position): not capturable."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from molt.modeling import ModelSpec

    config = {
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "vocab_size": 64,
    }
    dynamic = LlamaConfig(
        **config, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    )
    assert LlamaForCausalLM(dynamic).model.rotary_emb.rope_type == "dynamic"  # what the description reads
    assert (
        ModelSpec.from_config(dynamic).dynamic_rope
        and not ModelSpec.from_config(LlamaConfig(**config)).dynamic_rope
    )
    engine = HFEngine(str(tiny_llama_dir))
    assert not engine.spec.dynamic_rope
    asyncio.run(engine.close())
