"""`EngineProcess`: the HF engine in a child process behaves like the in-process one."""

import asyncio
import json

import numpy as np
import pytest
import torch

from molt.engine.base import EngineError, RequestError
from molt.engine.process import EngineProcess
from molt.types import FinishReason, SamplingParams, json_grammar


@pytest.fixture(scope="module")
def proc_engine(tiny_llama_dir):
    engine = EngineProcess("molt.engine.hf:HFEngine", str(tiny_llama_dir))
    yield engine
    asyncio.run(engine.close())


def test_same_tokens_and_logprobs_as_in_process(proc_engine, hf_engine):
    prompt = [5, 17, 42, 9]
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=11, top_logprobs=2)

    async def both(params):
        return await proc_engine.generate(prompt, params), await hf_engine.generate(prompt, params)

    remote, local = asyncio.run(both(params))
    assert remote.token_ids == local.token_ids and remote.versions == local.versions
    assert remote.logprobs == pytest.approx(local.logprobs, abs=1e-5)
    assert remote.top_logprobs is not None and len(remote.top_logprobs) == len(remote.token_ids)
    assert (
        proc_engine.model_name == hf_engine.model_name
        and proc_engine.eos_token_ids == hf_engine.eos_token_ids
    )
    schema = {
        "type": "array",
        "items": {"type": "boolean"},
        "maxItems": 3,
    }  # crosses the pipe, constrains there
    remote, local = asyncio.run(both(params.copy(max_tokens=60, grammar=json_grammar(schema))))
    assert remote.token_ids == local.token_ids and remote.logprobs == pytest.approx(local.logprobs, abs=1e-5)
    assert remote.finish_reason is FinishReason.STOP
    assert isinstance(json.loads(hf_engine.tokenizer.decode(remote.token_ids[:-1])), list)


def test_errors_cancel_and_refit_cross_the_process(proc_engine, tiny_llama_dir):
    async def main():
        with pytest.raises(RequestError, match="context window"):
            await proc_engine.generate([1] * (proc_engine.max_model_len + 1), SamplingParams(max_tokens=4))
        # cancelled once its first tokens have streamed back, so it cannot have finished (a fixed sleep raced
        # the tiny model's whole generation on a quiet machine)
        started = asyncio.Event()
        n = proc_engine.max_model_len - 2
        long = asyncio.create_task(
            proc_engine.generate(
                [3, 4], SamplingParams(max_tokens=n, min_tokens=n), on_tokens=lambda ids: started.set()
            )
        )
        await started.wait()
        long.cancel()  # aborts in the child; the engine keeps serving
        with pytest.raises(asyncio.CancelledError):
            await long
        many = await asyncio.gather(
            *[proc_engine.generate([7, i + 1], SamplingParams(max_tokens=5, min_tokens=5)) for i in range(8)]
        )
        assert all(len(c.token_ids) == 5 and c.finish_reason is FinishReason.LENGTH for c in many)
        before = await proc_engine.weight_sums()
        name = "model.layers.0.mlp.up_proj.weight"
        new = torch.full(tuple(_shape(tiny_llama_dir, name)), 0.5)
        assert proc_engine._shared is not None  # a CPU engine: the parent copies into shared memory
        with pytest.raises(EngineError, match="paused"):  # refused before any byte moves
            await proc_engine.update_weights([(name, new)], version=3)
        assert (await proc_engine.weight_sums())[name] == before[name]
        await proc_engine.pause()
        await proc_engine.update_weights([(name, new)], version=3)
        await proc_engine.resume()
        after = await proc_engine.weight_sums()
        done = await proc_engine.generate([7, 8], SamplingParams(max_tokens=3))
        return before[name], after[name], float(new.double().sum()), done

    before, after, expected, done = asyncio.run(main())
    assert after == expected != before
    assert proc_engine.version == 3 and set(done.versions) == {3}


def test_a_failing_start_raises_in_the_parent(tmp_path):
    with pytest.raises(
        Exception, match="not-a-model|does not appear|Can't load|Incorrect path|not found|No such"
    ):
        EngineProcess("molt.engine.hf:HFEngine", str(tmp_path / "not-a-model"))


def _shape(model_dir, name):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).state_dict()[name].shape


@pytest.mark.parametrize("which", ["process", "thread"])
def test_on_tokens_streams_every_token_in_order(proc_engine, hf_engine, which):
    engine = proc_engine if which == "process" else hf_engine
    seen = []

    async def main():
        return await engine.generate(
            [4, 8, 15], SamplingParams(max_tokens=12, min_tokens=12, seed=1), on_tokens=seen.append
        )

    completion = asyncio.run(main())
    assert [t for batch in seen for t in batch] == completion.token_ids and len(seen) == 12


def test_the_prefix_cache_serves_in_the_child(proc_engine):
    """Another session's request reuses the first one's blocks (their exactness: tests/engine/test_prefix_cache.py;
    this engine's weights were refit above, so no cold reference here)."""
    prompt = list(range(5, 45))
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=1.0, seed=5)

    async def main():
        first = await proc_engine.generate(prompt, params, "session-1")
        before = (await proc_engine.prefix_stats())["reused_tokens"]
        await proc_engine.generate(prompt + first.token_ids + [11, 12], params, "session-2")
        return (await proc_engine.prefix_stats())["reused_tokens"] - before

    assert asyncio.run(main()) == 32  # the whole blocks of the first request's row (47 tokens)


def test_one_client_interface_in_process_or_not():
    """An engine process names every coroutine of the in-process engine's interface, with its parameters (no
    `__getattr__` forwarding)."""
    import inspect

    from molt.engine.hf import HFEngine

    def interface(cls):
        return {
            name: list(inspect.signature(f).parameters)
            for name, f in inspect.getmembers(cls)
            if inspect.iscoroutinefunction(f) and not name.startswith("_")
        }

    assert interface(EngineProcess) == interface(HFEngine)
    assert {"pause", "resume", "prefix_stats", "weight_sums", "join_weight_group"} <= set(
        interface(EngineProcess)
    )


def test_an_int32_array_prompt_gives_what_its_list_gives(proc_engine, hf_engine):
    """Capture hands engines an int32 array (its bytes cross the pipe); in the child and in process it samples
    what the same prompt as a list samples (each engine against itself: a test above refits the child's)."""
    prompt = [5, 17, 42, 9, 300, 7]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3)

    async def run(engine):
        return [await engine.generate(p, params) for p in (prompt, np.asarray(prompt, np.int32))]

    for engine in (proc_engine, hf_engine):
        listed, array = asyncio.run(run(engine))
        assert array.token_ids == listed.token_ids and len(listed.token_ids) == 8
        assert array.logprobs == pytest.approx(listed.logprobs, abs=1e-6)
        assert array.prompt_tokens == len(prompt)
