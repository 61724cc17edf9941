"""The embedded engine against independent recomputations on tiny real checkpoints."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from molt.engine.base import Engine, EngineError, EngineGone, RequestError, copy_weights
from molt.engine.hf import HFEngine
from molt.types import FinishReason, SamplingParams

PROMPTS = [[5 + i % 7] + list(range(20, 20 + 3 * i)) for i in range(16)]  # lengths 1..46


@pytest.fixture
async def engine(tiny_llama_dir):
    eng = HFEngine(str(tiny_llama_dir))
    yield eng
    await eng.close()


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def recompute(model, prompt, completion, temperature):
    """Behavior log-probs by a plain forward pass over prompt + completion (molt.engine.base definition)."""
    ids = torch.tensor([prompt + completion.token_ids])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logp, logp.gather(1, torch.tensor(completion.token_ids)[:, None])[:, 0]


@torch.no_grad()
def hf_greedy(model, prompt, n):
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=n,
    )
    return out[0, len(prompt) :].tolist()


async def progress(engine, request_id, tokens, timeout=60.0):
    """Wait until a running request has generated at least `tokens` tokens (fails fast rather than hanging
    when the request ended first)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while request_id not in engine._active or len(engine._active[request_id].tokens) < tokens:
        assert asyncio.get_running_loop().time() < deadline, (
            f"request {request_id} never reached {tokens} tokens"
        )
        await asyncio.sleep(0.001)


def test_implements_protocol(tiny_llama_dir):
    eng = HFEngine(str(tiny_llama_dir), model_name="tiny")
    assert isinstance(eng, Engine) and eng.model_name == "tiny" and eng.max_model_len == 512
    assert eng.eos_token_ids == [eng.tokenizer.eos_token_id]
    asyncio.run(eng.close())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("model_dir", ["tiny_llama_dir", "tiny_moe_dir"])
async def test_logprobs_equal_forward_pass(request, model_dir, temperature):
    path = request.getfixturevalue(model_dir)
    eng = HFEngine(str(path))
    params = [
        SamplingParams(max_tokens=12 + i, temperature=temperature, seed=i, top_logprobs=3) for i in range(5)
    ]
    params[1] = params[1].copy(top_k=20, top_p=0.9)  # truncation changes the sampling set, not the record
    outs = await asyncio.gather(*[eng.generate(PROMPTS[3 * i], p) for i, p in enumerate(params)])
    await eng.close()
    model = load(path)
    for i, (p, out) in enumerate(zip(params, outs)):
        assert len(out.token_ids) == p.max_tokens or out.finish_reason is FinishReason.STOP
        logp, expected = recompute(model, PROMPTS[3 * i], out, temperature)
        assert torch.tensor(out.logprobs).sub(expected).abs().max() <= 1e-4
        top = torch.tensor([[lp for _, lp in row] for row in out.top_logprobs])
        assert top.sub(logp.topk(3, dim=-1).values).abs().max() <= 1e-4
        if p.top_k > 0:  # every sampled token is inside the top-k set of its distribution
            assert all(logp[j, t] >= logp[j].topk(20).values[-1] for j, t in enumerate(out.token_ids))


async def test_greedy_equals_model_generate(engine, tiny_llama_dir):
    out = await engine.generate(PROMPTS[4], SamplingParams(max_tokens=24, temperature=0))
    assert out.token_ids == hf_greedy(load(tiny_llama_dir), PROMPTS[4], 24)
    assert out.versions == [0] * 24 and out.prompt_tokens == len(PROMPTS[4])


async def test_greedy_equals_model_generate_moe(tiny_moe_dir):
    eng = HFEngine(str(tiny_moe_dir))
    out = await eng.generate(PROMPTS[6], SamplingParams(max_tokens=16, temperature=0))
    await eng.close()
    assert out.token_ids == hf_greedy(load(tiny_moe_dir), PROMPTS[6], 16)


async def test_16_concurrent_requests_match_solo_runs(tiny_llama_dir):
    """Different prompt lengths and max_tokens, sampled requests mixed in, some requests joining a running batch,
    a batch cap (requests queue) and a small prefill budget (prefills split): every greedy request equals its own
    solo `model.generate` run and every log-prob its recomputation."""
    engine = HFEngine(str(tiny_llama_dir), max_batch_size=6, max_prefill_tokens=64)

    async def one(i):
        if 8 <= i < 15:
            await progress(engine, "q15", 3)
        temperature = 1.0 if i % 4 == 3 else 0.0
        n = 5 + 2 * i  # sampled requests could draw EOS early: min_tokens keeps their length fixed
        params = SamplingParams(max_tokens=n, min_tokens=n if temperature else 0, temperature=temperature)
        return await engine.generate(PROMPTS[i], params, request_id=f"q{i}")

    outs = await asyncio.gather(*[one(i) for i in range(16)])
    await engine.close()
    model = load(tiny_llama_dir)
    for i, out in enumerate(outs):
        assert len(out.token_ids) == len(out.logprobs) == len(out.versions) == 5 + 2 * i
        if i % 4 != 3:
            assert out.token_ids == hf_greedy(model, PROMPTS[i], 5 + 2 * i), f"request {i}"
        _, expected = recompute(model, PROMPTS[i], out, 1.0)
        assert torch.tensor(out.logprobs).sub(expected).abs().max() <= 1e-4


async def test_seed_reproduces_solo_and_in_a_batch(engine):
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=1234)
    solo = await engine.generate(PROMPTS[5], params)
    again = await engine.generate(PROMPTS[5], params)
    others = [engine.generate(p, SamplingParams(max_tokens=30, temperature=1.0)) for p in PROMPTS[8:12]]
    batched, *_ = await asyncio.gather(engine.generate(PROMPTS[5], params), *others)
    other_seed = await engine.generate(PROMPTS[5], params.copy(seed=99))
    assert solo.token_ids == again.token_ids == batched.token_ids
    assert solo.token_ids != other_seed.token_ids


async def test_stop_tokens_and_min_tokens(engine, tiny_llama_dir):
    greedy = await engine.generate(PROMPTS[2], SamplingParams(max_tokens=20, temperature=0))
    stop = greedy.token_ids[6]
    out = await engine.generate(
        PROMPTS[2], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop])
    )
    first = greedy.token_ids.index(stop)
    assert out.token_ids == greedy.token_ids[: first + 1] and out.finish_reason is FinishReason.STOP
    # every token but two is a stop token: without min_tokens the first token stops, with min_tokens=5 the
    # first 5 are non-stop tokens and the first stop token after them ends the completion
    allowed = sorted(a for a in range(30, 40) if a != greedy.token_ids[0])[:2]
    stops = [t for t in range(engine.vocab_size) if t not in allowed]
    short = await engine.generate(
        PROMPTS[2], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=stops)
    )
    assert len(short.token_ids) == 1 and short.finish_reason is FinishReason.STOP
    forced = await engine.generate(
        PROMPTS[2], SamplingParams(max_tokens=20, temperature=1.0, min_tokens=5, stop_token_ids=stops, seed=0)
    )
    assert len(forced.token_ids) >= 5 and set(forced.token_ids[:-1]) <= set(allowed)
    assert forced.finish_reason is FinishReason.STOP and forced.token_ids[-1] in stops
    # suppression is a truncation: the record is the unmasked log_softmax, as in molt.engine.base
    _, expected = recompute(load(tiny_llama_dir), PROMPTS[2], forced, 1.0)
    assert torch.tensor(forced.logprobs).sub(expected).abs().max() <= 1e-4


async def test_max_tokens_none_runs_to_the_context_window(engine):
    prompt = PROMPTS[3] * 100
    prompt = prompt[: engine.max_model_len - 7]
    out = await engine.generate(prompt, SamplingParams(max_tokens=None, temperature=0))
    capped = await engine.generate(prompt, SamplingParams(max_tokens=100, temperature=0))
    assert len(out.token_ids) == len(capped.token_ids) == 7 and out.finish_reason is FinishReason.LENGTH


async def test_refit_changes_versions_and_weights_of_later_tokens_only(engine, tiny_llama_dir, tmp_path):
    from molt.testing.models import build_tiny_llama

    new_model = load(build_tiny_llama(tmp_path / "v1", seed=1))
    old_model = load(tiny_llama_dir)
    params = SamplingParams(max_tokens=64, min_tokens=64, temperature=0.7, seed=3)  # no early EOS
    tasks = [asyncio.create_task(engine.generate(PROMPTS[i], params, request_id=f"r{i}")) for i in (1, 9)]
    await progress(engine, "r1", 5)
    await progress(engine, "r9", 5)
    with pytest.raises(EngineError, match="paused"):
        await engine.update_weights([], version=1)
    await engine.pause()
    before = {rid: len(engine._active[rid].tokens) for rid in ("r1", "r9")}
    await asyncio.sleep(0.05)
    assert before == {rid: len(engine._active[rid].tokens) for rid in ("r1", "r9")}, "paused engine generated"
    # a trainer exporting tied weights sends the embedding once; two buckets
    named = [(k, v) for k, v in new_model.state_dict().items() if k != "lm_head.weight"]
    await engine.update_weights(named[:5], version=1)
    await engine.update_weights(named[5:], version=1)
    with pytest.raises(EngineError, match="not a parameter"):
        await engine.update_weights([("no.such.weight", torch.zeros(1))], version=1)
    assert engine.version == 1
    await engine.resume()
    outs = await asyncio.gather(*tasks)
    for (i, out), k in zip(zip((1, 9), outs), before.values()):
        assert 5 <= k < 64 and out.versions == [0] * k + [1] * (64 - k)
        _, old_lp = recompute(old_model, PROMPTS[i], out, 0.7)
        _, new_lp = recompute(new_model, PROMPTS[i], out, 0.7)
        lp = torch.tensor(out.logprobs)
        assert lp[:k].sub(old_lp[:k]).abs().max() <= 1e-4
        assert lp[k:].sub(new_lp[k:]).abs().max() <= 1e-4  # the new weights are really used
    after = await engine.generate(PROMPTS[0], SamplingParams(max_tokens=3, min_tokens=3))  # no early EOS
    assert after.versions == [1, 1, 1]


async def test_abort_and_cancel(engine):
    task = asyncio.create_task(
        engine.generate(PROMPTS[3], SamplingParams(max_tokens=400, min_tokens=400), request_id="a")
    )
    await progress(engine, "a", 3)
    await engine.abort("a")
    out = await task
    assert out.finish_reason is FinishReason.ABORT and 3 <= len(out.token_ids) < 400
    assert len(out.logprobs) == len(out.versions) == len(out.token_ids)
    # cancelling the awaiting task ends the request too, and the engine keeps serving
    task = asyncio.create_task(
        engine.generate(PROMPTS[3], SamplingParams(max_tokens=400, min_tokens=400), request_id="c")
    )
    await progress(engine, "c", 2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # abort while paused returns at once with what was generated
    await engine.pause()
    task = asyncio.create_task(
        engine.generate(PROMPTS[3], SamplingParams(max_tokens=400, min_tokens=400), request_id="p")
    )
    while "p" not in engine._active:  # the engine holds it: an abort before would find nothing to end
        await asyncio.sleep(0)
    await engine.abort("p")
    out = await asyncio.wait_for(task, 5)
    assert out.finish_reason is FinishReason.ABORT and out.token_ids == []
    await engine.resume()
    assert engine.num_requests == 0
    assert len((await engine.generate(PROMPTS[3], SamplingParams(max_tokens=4, min_tokens=4))).token_ids) == 4


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], SamplingParams(), "prompt is empty"),
        ([5] * 512, SamplingParams(), "context window"),
        ([5], SamplingParams(max_tokens=0), "max_tokens"),
        ([5], SamplingParams(temperature=-1.0), "temperature"),
        ([5], SamplingParams(top_p=0.0), "top_p"),
        ([10**6], SamplingParams(), "prompt token ids"),
        ([5], SamplingParams(stop_token_ids=[-1]), "stop token ids"),
    ],
)
async def test_bad_input_errors(engine, prompt, params, message):
    with pytest.raises(RequestError, match=message):
        await engine.generate(prompt, params)
    assert issubclass(RequestError, ValueError) and not issubclass(EngineError, ValueError)  # 400 vs 5xx


async def test_a_failing_step_ends_every_request_with_an_error(engine):
    """Requests kept across a refit re-prefill in the next step: if it raises, they fail with the running and
    the new ones; if the step loop itself breaks, every request fails and the engine refuses new ones."""
    params = SamplingParams(max_tokens=400, min_tokens=400)
    kept = [asyncio.create_task(engine.generate(PROMPTS[i], params, request_id=f"k{i}")) for i in (1, 2)]
    await progress(engine, "k1", 3)
    await progress(engine, "k2", 3)
    await engine.pause()
    await engine.update_weights([], version=1)  # the kept requests' caches are stale: they prefill again

    def boom(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    engine.runner._forward = boom
    await engine.resume()
    for task in kept:
        with pytest.raises(EngineError, match="illegal memory access"):
            await asyncio.wait_for(task, 10)
    del engine.runner._forward  # the engine goes on serving
    assert len((await engine.generate(PROMPTS[3], SamplingParams(max_tokens=2, min_tokens=2))).token_ids) == 2

    await engine.pause()
    waiting = asyncio.create_task(engine.generate(PROMPTS[1], params, request_id="w"))
    while "w" not in engine._active:
        await asyncio.sleep(0.001)
    engine.scheduler.schedule = (
        boom  # a failure outside a step (at the boundary the abort wakes) ends the thread
    )
    await engine.abort("w")
    with pytest.raises(EngineError, match="illegal memory access"):
        await asyncio.wait_for(waiting, 10)
    with pytest.raises(EngineGone, match="closed"):
        await engine.generate(PROMPTS[1], params)


def test_min_tokens_masks_each_row_its_own_stops_in_one_batch():
    """Rows with their own stop lists, greedy: a row under min_tokens never takes its stops (it takes its best
    other token); a row past it, or with other stops, takes its argmax; the records stay the unmasked ones."""
    import random
    from types import SimpleNamespace

    from molt.engine.sampling import sample

    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0, 3.0]] * 3)

    def row(stops, sampled, min_tokens):
        return SimpleNamespace(
            params=SamplingParams(max_tokens=9, temperature=0, min_tokens=min_tokens),
            tokens=[7] * sampled,
            stops=stops,
            generator=random.Random(0),
            matcher=None,
        )

    reqs = [row([1, 2], 0, 2), row([1], 2, 2), row([2, 4], 1, 3)]
    tokens, logprobs, _ = sample(logits, reqs)
    assert tokens == [
        4,
        1,
        1,
    ]  # row 0: 1 and 2 masked; row 1: past min_tokens; row 2: 2 and 4 masked, 1 is best
    expected = torch.log_softmax(logits[0], -1)
    assert logprobs == pytest.approx([float(expected[4]), float(expected[1]), float(expected[1])], abs=1e-6)


@pytest.mark.parametrize("native", [True, False])
async def test_auto_dtype_is_bf16_on_a_cpu_that_computes_it(tiny_llama_dir, monkeypatch, native):
    """dtype auto: bf16 where the CPU computes it natively (avx512_bf16), else fp32; a bf16 engine's log-probs
    stay within bf16 rounding of an fp32 forward over the sequence (the gap importance correction absorbs)."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    eng = HFEngine(str(tiny_llama_dir), dtype="auto")
    assert eng.model.dtype == (torch.bfloat16 if native else torch.float32)
    out = await eng.generate(
        PROMPTS[9], SamplingParams(max_tokens=16, min_tokens=16, temperature=1.0, seed=4)
    )
    await eng.close()
    _, expected = recompute(load(tiny_llama_dir), PROMPTS[9], out, 1.0)
    assert torch.tensor(out.logprobs).sub(expected).abs().max() <= (0.05 if native else 1e-4)


def test_fp32_weights_refit_into_bf16_round_stochastically():
    """bf16's step at 1.0 is 2**-7: 1 + 2**-9 lies a quarter of the way up, so a quarter of the copies round up and
    the mean stays at the fp32 value (to nearest: all round down to 1.0); a bf16 value copies exactly."""
    n, v = 40_000, 1 + 2**-9
    params = {"w": torch.zeros(2 * n + 1, dtype=torch.bfloat16)}
    copy_weights(params, [("w", torch.tensor([v] * n + [-v] * n + [3.0]))], "m")
    w = params["w"].float()
    for signed in (w[:n], -w[n:-1]):
        up = signed == 1 + 2**-7
        assert bool((up | (signed == 1.0)).all())
        assert float(up.float().mean()) == pytest.approx(0.25, abs=0.015)  # binomial sd 0.0022
        assert float(signed.double().mean()) == pytest.approx(v, abs=1e-4)
    assert float(w[-1]) == 3.0
