"""The session prefix cache: multi-turn requests reuse the previous turn's keys/values and give the same tokens
and log-probs as a cold prefill (fp32), through rewrites, refits, eviction and aborts."""

import asyncio

import pytest
import torch

from molt.engine.hf import HFEngine
from molt.engine.prefix_cache import MAX_ENTRIES_PER_SESSION, PrefixCache, common_prefix
from molt.types import FinishReason, SamplingParams

HISTORIES = [[5 + i] + list(range(30, 30 + 17 * i)) for i in range(1, 5)]  # lengths 18..69
USER = [11, 12, 13, 14]  # the next user message's tokens


def turn(i, n=10):
    return SamplingParams(max_tokens=n, min_tokens=n, temperature=1.0, seed=100 + i, top_logprobs=2)


async def reused(engine):
    return (await engine.prefix_stats())["reused_tokens"]


def assert_same(cached, cold):
    assert cached.token_ids == cold.token_ids and cached.versions == cold.versions
    assert torch.tensor(cached.logprobs).sub(torch.tensor(cold.logprobs)).abs().max() <= 1e-5
    tops = [[lp for _, lp in row] for c in (cached, cold) for row in c.top_logprobs]
    half = len(tops) // 2
    assert torch.tensor(tops[:half]).sub(torch.tensor(tops[half:])).abs().max() <= 1e-5


@pytest.fixture
async def engine(tiny_llama_dir):
    eng = HFEngine(str(tiny_llama_dir))
    yield eng
    await eng.close()


async def test_multi_turn_sessions_reuse_the_cache_and_stay_exact(engine):
    """Four sessions of different lengths run three turns together (new messages of different lengths, so the
    cached rows of one prefill have gaps of different widths), a request without a session in the same batch:
    each cached turn equals the same prompt sent cold (no session) and prefills only its new tokens."""
    prompts, expected = [list(h) for h in HISTORIES], 0
    for k in range(3):
        before = await reused(engine)
        outs = await asyncio.gather(
            *[engine.generate(p, turn(k), f"s{i}") for i, p in enumerate(prompts)],
            engine.generate(HISTORIES[0], turn(9)),
        )
        cached = outs[:-1]
        assert await reused(engine) - before == expected
        cold = await asyncio.gather(*[engine.generate(p, turn(k)) for p in prompts])
        for a, b in zip(cached, cold):
            assert_same(a, b)
        expected = sum(len(p) + len(out.token_ids) - 1 for p, out in zip(prompts, cached))
        prompts = [p + out.token_ids + USER[: i + 1] for i, (p, out) in enumerate(zip(prompts, cached))]


async def test_rewritten_history_reuses_the_common_prefix(engine):
    first = await engine.generate(HISTORIES[3], turn(0), "s")
    history = HISTORIES[3] + first.token_ids
    cases = [
        (history[:40] + [7, 8, 9], 40),  # the history rewritten after token 40
        (history + USER, len(history) - 1),  # the plain next turn: all but the unsampled last token
        (HISTORIES[3], len(HISTORIES[3]) - 1),
    ]  # the same prompt again: all but its last token
    for prompt, expected in cases:
        assert (
            await engine.generate(HISTORIES[3], turn(0), "s")
        ).token_ids == first.token_ids  # reset the entry
        before = await reused(engine)
        cached = await engine.generate(prompt, turn(1), "s")
        assert await reused(engine) - before == expected
        assert_same(cached, await engine.generate(prompt, turn(1)))


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
    cached = await engine.generate(second, turn(1), "s")
    cold = await new_weights.generate(second, turn(1))
    assert await reused(engine) == before and cached.versions == [1] * 10
    assert cached.token_ids == cold.token_ids
    assert torch.tensor(cached.logprobs).sub(torch.tensor(cold.logprobs)).abs().max() <= 1e-5
    await engine.close()
    await new_weights.close()


async def test_lru_eviction_under_a_byte_budget(tiny_llama_dir):
    # tiny Llama: 2 layers x (keys, values) x 2 kv heads x 16 dims x 4 bytes = 512 bytes a token; an entry of
    # 60 prompt + 9 sampled tokens is 35,328 bytes: two fit in 80 KiB, three do not
    engine = HFEngine(str(tiny_llama_dir), prefix_cache_mb=80 / 1024)
    outs = {}
    for s in ("a", "b", "c"):
        outs[s] = await engine.generate(HISTORIES[3][:60], turn(0), s)
        if s == "b":
            await engine.generate(HISTORIES[3][:60], turn(0), "a")  # a is used again: b is now the oldest
    assert await engine.prefix_stats() == {"entries": 2, "bytes": 2 * 69 * 512, "reused_tokens": 59}
    assert list(engine.prefixes.entries) == ["a", "c"]
    before = await reused(engine)
    await engine.generate(HISTORIES[3][:60] + outs["b"].token_ids, turn(1), "b")
    assert await reused(engine) == before  # b was evicted
    await engine.generate(
        [20 + i % 300 for i in range(200)], turn(0), "big"
    )  # larger than the whole budget: not kept
    assert "big" not in engine.prefixes.entries and engine.prefixes.nbytes <= 80 * 1024
    await engine.close()


async def test_aborted_requests_store_nothing_and_the_cache_can_be_off(tiny_llama_dir, engine):
    task = asyncio.create_task(
        engine.generate(HISTORIES[1], SamplingParams(max_tokens=400, min_tokens=400), "s", request_id="a")
    )
    while "a" not in engine._active or not engine._active["a"].tokens:
        await asyncio.sleep(0.001)
    await engine.abort("a")
    assert (await task).finish_reason is FinishReason.ABORT
    assert (await engine.prefix_stats())["entries"] == 0
    off = HFEngine(str(tiny_llama_dir), prefix_cache_mb=0)
    first = await off.generate(HISTORIES[1], turn(0), "s")
    await off.generate(HISTORIES[1] + first.token_ids, turn(1), "s")
    assert await off.prefix_stats() == {"entries": 0, "bytes": 0, "reused_tokens": 0}
    await off.close()


def test_lookup_takes_the_longest_common_prefix_but_never_the_last_token():
    cache = PrefixCache(1)
    kv = [(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4))]
    cache.store("s", [1, 2, 3, 4, 5], kv)
    assert cache.lookup("s", [1, 2, 9])[1] == 2
    assert cache.lookup("s", [1, 2, 3, 4, 5])[1] == 4
    assert cache.lookup("s", [1, 2, 3, 4, 5, 6, 7])[1] == 5
    assert cache.lookup("other", [1, 2, 3])[1] == 0 and cache.lookup(None, [1, 2, 3])[1] == 0
    assert cache.nbytes == 2 * 2 * 5 * 4 * 4
    cache.refit()
    assert cache.stats() == {"entries": 0, "bytes": 0, "reused_tokens": 2 + 4 + 5}
    with pytest.raises(ValueError, match="prefix_cache_mb"):
        PrefixCache(-1)


async def test_a_side_request_does_not_evict_the_conversation(engine):
    """A harness's side request on the session (a title under another system prompt, sharing almost nothing at
    the start) between two turns: the next turn still reuses its whole history, exactly, and the side request's
    own repeat reuses its entry too (issue 37: the next turn re-prefilled 23K tokens)."""
    main, side = HISTORIES[3], [6] + HISTORIES[3][1:]  # the same content under another first token
    first = await engine.generate(main, turn(0), "s")
    title = await engine.generate(side, turn(1), "s")
    before = await reused(engine)
    second = main + first.token_ids + USER
    cached = await engine.generate(second, turn(2), "s")
    assert await reused(engine) - before == len(main) + len(first.token_ids) - 1
    assert_same(cached, await engine.generate(second, turn(2)))
    before = await reused(engine)
    await engine.generate(side + title.token_ids + USER, turn(3), "s")
    assert await reused(engine) - before == len(side) + len(title.token_ids) - 1


def test_entries_per_session_are_bounded_and_a_longer_turn_replaces_its_prefix():
    kv = lambda n: [(torch.zeros(1, 2, n, 4), torch.zeros(1, 2, n, 4))]  # 64 bytes a token
    cache = PrefixCache(1000 * 64 / 2**20)  # room for 1,000 tokens
    cache.store("s", [1, 2, 3], kv(3))
    cache.store("s", [1, 2, 3, 4, 5], kv(5))  # the next turn: the shorter entry goes
    assert cache.stats()["entries"] == 1 and cache.lookup("s", [1, 2, 3, 4, 5, 6])[1] == 5
    for first in range(10, 10 + MAX_ENTRIES_PER_SESSION):  # side requests: each its own entry, up to the cap
        cache.store("s", [first, 2, 3], kv(3))
    assert cache.stats()["entries"] == MAX_ENTRIES_PER_SESSION
    assert cache.lookup("s", [1, 2, 3, 4, 5, 6])[1] == 0  # the oldest went first
    assert cache.lookup("s", [13, 2, 3, 7])[1] == 3
    # the byte budget: the least recent session's oldest
    cache.store("t", list(range(990)), kv(990))
    assert cache.nbytes <= 1000 * 64 and cache.stats()["entries"] == MAX_ENTRIES_PER_SESSION
    assert cache.lookup("s", [13, 2, 3, 7])[1] == 3 and cache.lookup("s", [10, 2, 3, 7])[1] == 0
    assert common_prefix(list(range(2000)), list(range(1500)) + [0]) == 1500 and common_prefix([], [1]) == 0


async def test_requests_with_one_prompt_prefill_it_once(engine):
    """A GRPO step's samples: eight requests with one prompt and three with another arrive together (the engine
    paused meanwhile) and prefill two rows; each equals the same seeded request sent alone."""
    prompts = [HISTORIES[1]] * 8 + [HISTORIES[2]] * 3
    rows = []
    hook = engine.model.register_forward_pre_hook(
        lambda _m, _a, kw: rows.append(kw["input_ids"].shape[0]) if kw["input_ids"].shape[1] > 1 else None,
        with_kwargs=True,
    )
    await engine.pause()
    batch = [asyncio.ensure_future(engine.generate(p, turn(i))) for i, p in enumerate(prompts)]
    while engine.num_requests < len(prompts):  # all of them wait in the paused engine
        await asyncio.sleep(0)
    await engine.resume()
    together = await asyncio.gather(*batch)
    assert rows == [2]
    hook.remove()
    for i, (p, out) in enumerate(zip(prompts, together)):
        assert_same(out, await engine.generate(p, turn(i)))
    assert len({tuple(out.token_ids) for out in together[:8]}) > 1  # the copies sample on their own
