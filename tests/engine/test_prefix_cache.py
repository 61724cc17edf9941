"""The prefix cache, shared across sessions in blocks: a request reuses the longest cached prefix whichever session
computed it and gives the same tokens and log-probs as a cold prefill (an engine without the cache, fp32), through
multi-turn sessions, rewrites, refits, eviction and aborts; a prefix in flight is computed once."""

import asyncio
import threading

import pytest
import torch

from molt.engine.hf import HFEngine
from molt.engine.prefix_cache import BLOCK, PrefixCache, block_keys, common_prefix
from molt.types import FinishReason, SamplingParams

HISTORIES = [[5 + i] + list(range(30, 30 + 17 * i)) for i in range(1, 5)]  # lengths 18..69
USER = [11, 12, 13, 14]  # the next user message's tokens
SYSTEM = [(7 * i) % 300 + 10 for i in range(300)]  # a long shared system prompt


def turn(i, n=10):
    return SamplingParams(max_tokens=n, min_tokens=n, temperature=1.0, seed=100 + i, top_logprobs=2)


def blocks(n):
    """Tokens of the whole blocks a context of n tokens can reuse (never its last token)."""
    return (n - 1) // BLOCK * BLOCK


async def together(engine, *calls):
    """The requests reach the engine in one step (paused until all have arrived), in this order."""
    await engine.pause()
    tasks = []
    for call in calls:
        tasks.append(asyncio.ensure_future(call))
        while engine.num_requests < len(tasks):
            await asyncio.sleep(0)
    await engine.resume()
    return await asyncio.gather(*tasks)


async def reused(engine):
    return (await engine.prefix_stats())["reused_tokens"]


def assert_same(cached, cold, tol=1e-5):
    assert cached.token_ids == cold.token_ids and cached.versions == cold.versions
    assert torch.tensor(cached.logprobs).sub(torch.tensor(cold.logprobs)).abs().max() <= tol
    tops = [[lp for _, lp in row] for c in (cached, cold) for row in c.top_logprobs]
    half = len(tops) // 2
    assert torch.tensor(tops[:half]).sub(torch.tensor(tops[half:])).abs().max() <= tol


@pytest.fixture
async def engine(tiny_llama_dir):
    eng = HFEngine(str(tiny_llama_dir))
    yield eng
    await eng.close()


@pytest.fixture
async def cold(tiny_llama_dir):
    """The reference: every request a cold prefill."""
    eng = HFEngine(str(tiny_llama_dir), prefix_cache_mb=0)
    yield eng
    await eng.close()


async def test_a_new_session_reuses_what_another_computed(engine, cold):
    """Session a's prompt, then together: session b with the same system prompt and its own question, session c
    with a's exact prompt, a request without a session with a's prompt and a's reply: each reuses its whole
    blocks of what a computed and equals a cold prefill."""
    first = await engine.generate(SYSTEM + [1, 2], turn(0), "a")
    prompts = [SYSTEM + [3, 4, 5], SYSTEM + [1, 2], SYSTEM + [1, 2] + first.token_ids + USER]
    before = await reused(engine)
    outs = await together(
        engine,
        engine.generate(prompts[0], turn(1), "b"),
        engine.generate(prompts[1], turn(2), "c"),
        engine.generate(prompts[2], turn(3)),
    )
    assert await reused(engine) - before == blocks(301) + blocks(302) + blocks(
        len(prompts[2]) - len(USER) + 1
    )
    for i, (p, out) in enumerate(zip(prompts, outs)):
        assert_same(out, await cold.generate(p, turn(i + 1)))


async def test_multi_turn_sessions_reuse_the_cache_and_stay_exact(engine, cold):
    """Four sessions of different lengths run three turns together (new messages of different lengths, so the
    cached rows of one prefill have gaps of different widths), a request without a session in the same batch:
    each turn equals a cold prefill and prefills only what the previous turn did not leave in whole blocks."""
    prompts, expected = [list(h) for h in HISTORIES], 0
    for k in range(3):
        before = await reused(engine)
        outs = await together(
            engine,
            *[engine.generate(p, turn(k), f"s{i}") for i, p in enumerate(prompts)],
            engine.generate(HISTORIES[0], turn(9)),
        )
        assert await reused(engine) - before == expected
        for p, out in zip(prompts, outs):
            assert_same(out, await cold.generate(p, turn(k)))
        # the previous turn's row left blocks of its prompt and reply; the lone request finds HISTORIES[0]'s
        expected = sum(blocks(len(p) + len(out.token_ids)) for p, out in zip(prompts, outs)) + blocks(18)
        prompts = [p + out.token_ids + USER[: i + 1] for i, (p, out) in enumerate(zip(prompts, outs))]


async def test_rewritten_history_reuses_the_common_prefix_in_whole_blocks(engine, cold):
    first = await engine.generate(HISTORIES[3], turn(0), "s")
    history = HISTORIES[3] + first.token_ids
    cases = [
        (history[:40] + [7, 8, 9], 32),  # rewritten after token 40: two whole blocks still match
        (history + USER, blocks(len(history))),  # the plain next turn
        (HISTORIES[3], blocks(len(HISTORIES[3]))),  # the same prompt again
    ]
    for prompt, expected in cases:
        before = await reused(engine)
        assert_same(await engine.generate(prompt, turn(1), "s"), await cold.generate(prompt, turn(1)))
        assert await reused(engine) - before == expected


async def test_refit_drops_the_cache(tiny_llama_dir, tmp_path):
    from molt.testing.models import build_tiny_llama

    new_weights = HFEngine(str(build_tiny_llama(tmp_path / "v1", seed=1)), prefix_cache_mb=0)
    engine = HFEngine(str(tiny_llama_dir))
    first = await engine.generate(HISTORIES[2], turn(0), "s")
    await engine.pause()
    await engine.update_weights(list(new_weights.model.state_dict().items()), version=1)
    await engine.resume()
    second = HISTORIES[2] + first.token_ids + USER
    before = await reused(engine)
    cached = await engine.generate(second, turn(1), "t")
    cold = await new_weights.generate(second, turn(1))
    assert await reused(engine) == before and cached.versions == [1] * 10
    assert cached.token_ids == cold.token_ids
    assert torch.tensor(cached.logprobs).sub(torch.tensor(cold.logprobs)).abs().max() <= 1e-5
    await engine.close()
    await new_weights.close()


def test_lru_eviction_under_a_byte_budget_takes_a_chains_last_blocks_first():
    kv = lambda n: [(torch.zeros(1, 2, n, 4), torch.zeros(1, 2, n, 4))]  # 64 bytes a token, 1 KiB a block
    cache = PrefixCache(8 / 1024)  # room for 8 blocks
    a, b, c = ([first] + list(range(100, 100 + 5 * BLOCK - 1)) for first in (1, 2, 3))  # 5 blocks each
    cache.store(a, kv(len(a)))
    cache.store(b, kv(len(b)))  # 10 blocks: a's last two go
    assert cache.stats() == {"blocks": 8, "bytes": 8 * 1024, "reused_tokens": 0}
    assert cache.lookup(a + [0])[1] == 3 and cache.lookup(b + [0])[1] == 5
    cache.take(block_keys(a)[:3])  # a's blocks are used again: b's are now the oldest
    cache.store(c, kv(len(c)))
    assert cache.lookup(a + [0])[1] == 3 and cache.lookup(b + [0])[1] == 0 and cache.lookup(c + [0])[1] == 5
    assert cache.nbytes == 8 * 1024 and cache.reused_tokens == 3 * BLOCK
    cache.store(list(range(20 * BLOCK)), kv(20 * BLOCK))  # larger than the whole budget: its first 8 stay
    assert cache.lookup(list(range(20 * BLOCK)))[1] == 8 and cache.nbytes == 8 * 1024


async def test_aborted_requests_keep_only_their_prompt_and_the_cache_can_be_off(engine, cold):
    task = asyncio.create_task(
        engine.generate(HISTORIES[1], SamplingParams(max_tokens=400, min_tokens=400), "s", request_id="a")
    )
    while "a" not in engine._active or len(engine._active["a"].tokens) < 2 * BLOCK:
        await asyncio.sleep(0.001)
    await engine.abort("a")
    assert (await task).finish_reason is FinishReason.ABORT
    assert (await engine.prefix_stats())["blocks"] == len(
        HISTORIES[1]
    ) // BLOCK  # the prefill's, not the reply's
    first = await cold.generate(HISTORIES[1], turn(0), "s")
    await cold.generate(HISTORIES[1] + first.token_ids, turn(1), "s")
    assert await cold.prefix_stats() == {"blocks": 0, "bytes": 0, "reused_tokens": 0}


def test_lookup_takes_whole_blocks_but_never_the_last_token():
    cache = PrefixCache(1)
    tokens = list(range(3 * BLOCK))
    cache.store(tokens, [(torch.zeros(1, 2, 3 * BLOCK, 4), torch.ones(1, 2, 3 * BLOCK, 4))])
    assert cache.lookup(tokens[:BLOCK] + [9] * BLOCK)[1] == 1  # diverges in the second block
    assert cache.lookup(tokens)[1] == 2 and cache.lookup(tokens + [7])[1] == 3
    assert cache.lookup([9] + tokens)[1] == 0  # a block's key is its whole prefix's
    prefix = cache.take(cache.lookup(tokens + [7])[0])
    assert len(prefix.layers) == 1 and prefix.layers[0][0].shape == (1, 2, 3 * BLOCK, 4)
    assert prefix.layers[0][0].sum() == 0 and prefix.layers[0][1].min() == 1
    assert cache.nbytes == 2 * 2 * 3 * BLOCK * 4 * 4
    cache.refit()
    assert cache.stats() == {"blocks": 0, "bytes": 0, "reused_tokens": 3 * BLOCK}
    with pytest.raises(ValueError, match="prefix_cache_mb"):
        PrefixCache(-1)
    assert common_prefix(list(range(2000)), list(range(1500)) + [0]) == 1500 and common_prefix([], [1]) == 0


def prefill_rows(engine):
    """(rows, columns) of every prefill forward of `engine` (a decode step has one column)."""
    seen = []
    engine.model.register_forward_pre_hook(
        lambda _m, _a, kw: (
            seen.append(tuple(kw["input_ids"].shape)) if kw["input_ids"].shape[1] > 1 else None
        ),
        with_kwargs=True,
    )
    return seen


async def test_requests_with_one_prompt_prefill_it_once(engine, cold):
    """A GRPO step's samples: eight requests with one prompt and three with another arrive together (the engine
    paused meanwhile) and prefill two rows; each equals the same seeded request sent alone."""
    prompts = [HISTORIES[1]] * 8 + [HISTORIES[2]] * 3
    rows = prefill_rows(engine)
    outs = await together(engine, *[engine.generate(p, turn(i)) for i, p in enumerate(prompts)])
    assert [r for r, _ in rows] == [2]
    for i, (p, out) in enumerate(zip(prompts, outs)):
        assert_same(out, await cold.generate(p, turn(i)))
    assert len({tuple(out.token_ids) for out in outs[:8]}) > 1  # the copies sample on their own


async def test_rollouts_sharing_a_long_system_prompt_arriving_together_prefill_it_once(engine, cold):
    """Eight harness rollouts, one system prompt and each its own task, arrive together: the first prefills the
    system prompt, the others wait for it and then prefill only their own tokens; each equals a cold prefill."""
    prompts = [SYSTEM + [20 + i] * (i + 1) for i in range(8)]
    rows = prefill_rows(engine)
    outs = await together(engine, *[engine.generate(p, turn(i), f"r{i}") for i, p in enumerate(prompts)])
    assert rows[0] == (1, len(prompts[0])) and sum(r * c for r, c in rows[1:]) <= 7 * (8 + BLOCK)
    for i, (p, out) in enumerate(zip(prompts, outs)):
        assert_same(out, await cold.generate(p, turn(i)))


async def test_a_request_arriving_during_a_long_prefill_waits_for_its_blocks(tiny_llama_dir, cold):
    """A second rollout arrives while the first one's system prompt is prefilled in chunks over several steps:
    it waits, then computes only its own tokens (and the last partial block); both equal a cold prefill."""
    engine = HFEngine(str(tiny_llama_dir), max_prefill_tokens=64)
    seen, queued = [], threading.Event()

    def hook(_module, _args, kwargs):
        rows, columns = kwargs["input_ids"].shape
        if columns > 1:
            seen.append(rows * columns)
            if len(seen) == 1:  # hold the first chunk until the second request is queued
                queued.wait(10)

    engine.model.register_forward_pre_hook(hook, with_kwargs=True)
    prompts = [SYSTEM + [1], SYSTEM + [2, 3]]
    first = asyncio.ensure_future(engine.generate(prompts[0], turn(0), "a"))
    while not seen:
        await asyncio.sleep(0.001)
    second = asyncio.ensure_future(engine.generate(prompts[1], turn(1), "b"))
    while engine.num_requests < 2:
        await asyncio.sleep(0)
    queued.set()
    outs = await asyncio.gather(first, second)
    await engine.close()
    assert len(seen) > 2 and sum(seen) == len(prompts[0]) + len(prompts[1]) - blocks(len(prompts[1]))
    for i, (p, out) in enumerate(zip(prompts, outs)):
        assert_same(out, await cold.generate(p, turn(i)))


@pytest.mark.slow
async def test_smollm2_a_second_session_equals_a_cold_prefill():
    from molt.models import default_cache_dir

    path = default_cache_dir() / "smollm2-135m-instruct"
    if not path.is_dir():
        pytest.skip("SmolLM2 is not converted here (make demo converts it)")
    engine, cold = HFEngine(str(path)), HFEngine(str(path), prefix_cache_mb=0)
    tokens = engine.tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "You are a careful assistant. " * 60},
            {"role": "user", "content": "Hi!"},
        ],
        add_generation_prompt=True,
        return_dict=False,
    )
    await engine.generate(tokens, turn(0), "a")
    before = await reused(engine)
    second = await engine.generate(tokens, turn(1), "b")
    assert await reused(engine) - before == blocks(len(tokens))
    # a real model's fp32 rounding differs between one forward and two over 377 tokens (1e-5 on a log-prob of -9.9)
    assert_same(second, await cold.generate(tokens, turn(1)), tol=1e-4)
    await engine.close()
    await cold.close()
