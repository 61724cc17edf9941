"""The vLLM engine's pure helpers with hand-computed values, and its pause / refit / abort logic against a
stand-in for `AsyncLLM` (fast, in the default suite). On real vLLM: tests/engine/test_vllm_real.py."""

import asyncio
import importlib.util
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from fake_vllm import FakeAsyncLLM, fake_reload, lp

from molt.engine import vllm as mv
from molt.engine import vllm_worker as vw
from molt.engine.base import Engine, EngineError, EngineGone, RequestError
from molt.types import FinishReason, SamplingParams, json_grammar

HAS_VLLM = importlib.util.find_spec("vllm") is not None


# ------------------------------------------------------------------------------ pure helpers


def test_import_is_light_and_construction_says_what_to_install():
    code = "import sys, molt.engine.vllm; assert 'vllm' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    if not HAS_VLLM:
        with pytest.raises(ValueError, match=r"pip install molt\[vllm\].*GPU"):
            mv.VLLMEngine("/nonexistent")


def test_sampling_kwargs():
    p = SamplingParams(
        max_tokens=10,
        temperature=0.7,
        top_p=0.9,
        top_k=0,
        min_tokens=5,
        stop_token_ids=[7],
        seed=3,
        top_logprobs=2,
    )
    assert mv.sampling_kwargs(p, 10, [2, 7]) == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "max_tokens": 10,
        "min_tokens": 5,
        "stop_token_ids": [2, 7],
        "seed": 3,
        "logprobs": 2,
        "detokenize": False,
    }
    assert mv.sampling_kwargs(p.copy(top_k=5, seed=None), 10, [2])["top_k"] == 5
    assert mv.sampling_kwargs(p.copy(seed=None), 10, [2])["seed"] is None
    assert mv.sampling_kwargs(p.copy(min_tokens=50), 10, [2])["min_tokens"] == 10  # vLLM needs min <= max
    assert mv.sampling_kwargs(p, 10, [2])["logprobs"] == 2
    assert mv.sampling_kwargs(p.copy(top_logprobs=0), 10, [2])["logprobs"] == 0  # 0: the sampled token only
    schema = {"type": "object"}
    assert mv.sampling_kwargs(p.copy(grammar=json_grammar(schema)), 10, [2])["structured_outputs"] == {
        "grammar": json_grammar(schema)
    }


def test_finish_reason_mapping():
    assert mv.finish_reason("stop") is FinishReason.STOP
    assert mv.finish_reason("length") is FinishReason.LENGTH
    assert mv.finish_reason("abort") is FinishReason.ABORT
    with pytest.raises(EngineError, match="error"):
        mv.finish_reason("error")
    with pytest.raises(EngineError):
        mv.finish_reason(None)


def test_read_output_sampled_logprobs_and_top_alternatives():
    # token 5 was sampled with rank 3 (outside the top 2, so vLLM sent 3 entries); token 9 was the best
    out = SimpleNamespace(
        token_ids=[5, 9],
        logprobs=[
            {5: lp(-1.5, 3), 9: lp(-0.2, 1), 4: lp(-0.9, 2)},
            {9: lp(-0.1, 1), 4: lp(-2.5, 2)},
        ],
    )
    tokens, logprobs, tops = mv.read_output(out, 2)
    assert tokens == [5, 9] and logprobs == [-1.5, -0.1]
    assert tops == [[(9, -0.2), (4, -0.9)], [(9, -0.1), (4, -2.5)]]
    assert mv.read_output(out, 0)[2] == []
    assert mv.read_output(SimpleNamespace(token_ids=[], logprobs=None), 2) == ([], [], [])
    with pytest.raises(EngineError, match="NaN log-prob"):  # never into training
        mv.read_output(SimpleNamespace(token_ids=[5], logprobs=[{5: lp(float("nan"), 1)}]), 0)


def test_receive_versions_across_a_refit():
    req = mv._Request(
        id="r", prompt=[1, 2], params=SamplingParams(max_tokens=8, top_logprobs=1), max_new=8, stops=[0]
    )
    # two DELTA outputs under version 4, then a refit
    assert req.receive(
        SimpleNamespace(token_ids=[11], finish_reason=None, logprobs=[{11: lp(-0.5, 1)}]), 4
    ) == [11]
    req.receive(
        SimpleNamespace(
            token_ids=[12, 13], finish_reason=None, logprobs=[{12: lp(-0.25, 1)}, {13: lp(-1.0, 1)}]
        ),
        4,
    )
    assert req.finish is None and req.versions == [4, 4, 4]
    # under version 5 it ends with the stop token, which stays in the output
    req.receive(
        SimpleNamespace(
            token_ids=[14, 0],
            finish_reason="stop",
            logprobs=[{14: lp(-2.0, 1)}, {0: lp(-3.0, 2), 7: lp(-0.1, 1)}],
        ),
        5,
    )
    out = req.completion()
    assert out.token_ids == [11, 12, 13, 14, 0] and out.versions == [4, 4, 4, 5, 5]
    assert out.logprobs == [-0.5, -0.25, -1.0, -2.0, -3.0] and out.finish_reason is FinishReason.STOP
    assert out.top_logprobs == [[(11, -0.5)], [(12, -0.25)], [(13, -1.0)], [(14, -2.0)], [(7, -0.1)]]
    assert out.prompt_tokens == 2


def test_pack_unpack_and_worker_extension_roundtrip(monkeypatch):
    tensors = [
        ("a", torch.randn(3, 4)),
        ("b", torch.randn(5).to(torch.bfloat16)),
        ("c", torch.tensor(7)),
        ("d", torch.zeros(0, 2, dtype=torch.float16)),
        ("e", torch.arange(6).reshape(2, 3).t()),
    ]
    packed = vw.pack(iter(tensors))
    assert all([type(v) for v in x] == [str, bytes, str, tuple] for x in packed)
    loaded = {}
    model = SimpleNamespace(load_weights=lambda weights: loaded.update(weights), loads=[])
    worker = type("Worker", (vw.WorkerExtension,), {})()
    worker.model_runner, worker.device = SimpleNamespace(get_model=lambda: model), "cpu"
    fake_reload(monkeypatch)
    worker.molt_load_weights([list(x[:3]) + [list(x[3])] for x in packed])  # as msgpack delivers it
    assert list(loaded) == ["a", "b", "c", "d", "e"] and model.loads == ["start"]
    for name, t in tensors:
        assert (
            loaded[name].dtype == t.dtype and loaded[name].shape == t.shape and torch.equal(loaded[name], t)
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_worker_rounds_fp32_weights_into_a_bf16_model_stochastically(dtype, monkeypatch):
    """In a bf16 vLLM model an fp32 weight of 1 + 2**-9 (a quarter of bf16's step above 1.0) loads as 1 + 2**-7 a
    quarter of the time and as 1.0 otherwise, the mean kept (to nearest: always 1.0); a bf16 tensor, and any
    tensor into an fp32 model, passes as sent."""
    n, v = 40_000, 1 + 2**-9
    sent = [("w", torch.full((n,), v)), ("b", torch.full((3,), v).to(torch.bfloat16))]
    loaded = {}
    model = SimpleNamespace(load_weights=lambda weights: loaded.update(weights), loads=[])
    worker = type("Worker", (vw.WorkerExtension,), {})()
    worker.model_runner, worker.device = SimpleNamespace(get_model=lambda: model), "cpu"
    worker.model_config = SimpleNamespace(dtype=dtype)
    fake_reload(monkeypatch)
    worker.molt_load_weights(vw.pack(sent))
    w, up = loaded["w"], loaded["w"] == 1 + 2**-7
    assert torch.equal(loaded["b"], sent[1][1]) and w.dtype == torch.float32
    if dtype == torch.float32:
        assert torch.equal(w, sent[0][1])
    else:
        assert bool((up | (w == 1.0)).all())
        assert float(up.float().mean()) == pytest.approx(0.25, abs=0.015)  # binomial sd 0.0022
        assert float(w.double().mean()) == pytest.approx(v, abs=1e-4)


# ------------------------------------------------------------------------------ engine logic, stand-in AsyncLLM


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """A VLLMEngine on the stand-in; the checkpoint directory only holds a config (EOS id 2)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2}))
    monkeypatch.setattr(mv, "_import_vllm", lambda: (_fake_vllm(), FakeAsyncLLM))
    fake_reload(monkeypatch)
    return mv.VLLMEngine(str(tmp_path), model_name="tiny", tensor_parallel_size=2, max_num_seqs=8)


def _fake_vllm(cpu: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        AsyncEngineArgs=lambda **kw: kw,
        SamplingParams=lambda **kw: kw,
        config=SimpleNamespace(StructuredOutputsConfig=lambda **kw: ("config", kw)),
        sampling_params=SimpleNamespace(
            RequestOutputKind=SimpleNamespace(DELTA="delta"),
            StructuredOutputsParams=lambda **kw: ("params", kw),
        ),
        platforms=SimpleNamespace(current_platform=SimpleNamespace(is_cpu=lambda: cpu)),
    )


@pytest.mark.parametrize("cpu", [False, True])
def test_cpu_build_defaults(cpu, monkeypatch, tmp_path):
    """vLLM's CPU build: dtype auto is float32 (what the CPU trainer computes; vLLM's auto would downcast to
    bf16), the KV cache CPU_KV_CACHE_GIB unless VLLM_CPU_KVCACHE_SPACE sets it (vLLM's own default takes a
    share of the machine's memory) and chunked prefill off; a GPU build's arguments are vLLM's."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2}))
    monkeypatch.setattr(mv, "_import_vllm", lambda: (_fake_vllm(cpu), FakeAsyncLLM))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    args = mv.VLLMEngine(str(tmp_path))._llm.args
    assert args["dtype"] == ("float32" if cpu else "auto")
    assert args.get("kv_cache_memory_bytes") == (mv.CPU_KV_CACHE_GIB << 30 if cpu else None)
    # unchunked prefill on the CPU build, with a token budget that holds the longest prompt (llama's 2048 here)
    assert (args.get("enable_chunked_prefill"), args.get("max_num_batched_tokens")) == (
        (False, 4096) if cpu else (None, None)
    )
    assert mv.VLLMEngine(str(tmp_path), max_model_len=9000)._llm.args.get("max_num_batched_tokens") == (
        9000 if cpu else None
    )
    assert mv.VLLMEngine(str(tmp_path), dtype="bfloat16")._llm.args["dtype"] == "bfloat16"
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert "kv_cache_memory_bytes" not in mv.VLLMEngine(str(tmp_path))._llm.args


def test_cpu_overrides_are_said_and_speculation_refused_where_it_breaks_logprobs(
    monkeypatch, tmp_path, caplog
):
    """Engine args vLLM's CPU build replaces without an error (the reference's --vllm.attention_backend,
    --vllm.async_scheduling, --vllm.distributed_executor_backend uni) are one start-up warning each, values it
    keeps none. Speculative decoding is a ValueError naming the field: on the CPU build (wrong log-probs at
    temperature > 0, bench/spec_decode.py), on a VLM (vLLM refuses logit_bias with it, which bans image tokens),
    and where vLLM does not implement it for the model."""
    from molt.testing.models import build_tiny_vlm

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2}))
    monkeypatch.setattr(mv, "_import_vllm", lambda: (_fake_vllm(True), FakeAsyncLLM))
    with caplog.at_level("WARNING", logger=mv.__name__):
        mv.VLLMEngine(
            str(tmp_path),
            attention_backend="FLASH_ATTN",
            async_scheduling=True,
            distributed_executor_backend="uni",
        )
        mv.VLLMEngine(
            str(tmp_path),
            attention_backend="CPU_ATTN",
            async_scheduling=False,
            distributed_executor_backend="ray",
        )
    said = [
        r.getMessage().split(" and uses ")[0].removeprefix("vLLM's CPU build ignores ")
        for r in caplog.records
    ]
    assert said == [
        "attention_backend='FLASH_ATTN'",
        "async_scheduling=True",
        "distributed_executor_backend='uni'",
    ]
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="speculative_config: vLLM 0.32's CPU build returns wrong log-probs"):
        mv.VLLMEngine(str(tmp_path), speculative_config=ngram)

    class NoMTP(FakeAsyncLLM):
        @classmethod
        def from_engine_args(cls, args):  # vLLM 0.32 on a model without MTP layers
            raise NotImplementedError("Unsupported speculative method: 'mtp'")

    monkeypatch.setattr(mv, "_import_vllm", lambda: (_fake_vllm(False), NoMTP))  # a GPU build
    with pytest.raises(ValueError, match="speculative_config: vLLM refuses logit_bias"):
        mv.VLLMEngine(str(build_tiny_vlm(tmp_path / "vlm")), speculative_config=ngram)
    with pytest.raises(
        ValueError, match="refused the engine arguments: Unsupported speculative method: 'mtp'"
    ):
        mv.VLLMEngine(str(tmp_path), speculative_config={"method": "mtp", "num_speculative_tokens": 1})


async def until(predicate, turns=10_000):
    for _ in range(turns):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


async def refit(engine, *weights, version=1):
    """pause, one bucket per weight, resume"""
    await engine.pause()
    for w in weights:
        await engine.update_weights([("w", torch.tensor(w))], version=version)
    await engine.resume()


async def test_construction_passes_engine_args(fake):
    args = fake._llm.args
    assert isinstance(fake, Engine) and fake.model_name == "tiny" and fake.eos_token_ids == [2]
    assert fake.max_model_len == 64 and fake.vocab_size == 1000
    assert args["logprobs_mode"] == "processed_logprobs" and args["tensor_parallel_size"] == 2
    assert args["max_num_seqs"] == 8 and args["served_model_name"] == "tiny"
    module, cls = args["worker_extension_cls"].rsplit(".", 1)
    assert getattr(importlib.import_module(module), cls) is vw.WorkerExtension  # importable by vLLM's workers


async def test_generate_stop_token_included(fake):
    out = await fake.generate([10], SamplingParams(max_tokens=20, stop_token_ids=[15], top_logprobs=1))
    assert out.token_ids == [11, 12, 13, 14, 15] and out.finish_reason is FinishReason.STOP
    assert out.versions == [0] * 5 and out.logprobs == [0.0] * 5 and out.top_logprobs[0] == [(11, 0.0)]
    assert fake._llm.requests[0][2]["stop_token_ids"] == [2, 15]
    out = await fake.generate([10], SamplingParams(max_tokens=None, stop_token_ids=[15], min_tokens=6))
    assert out.finish_reason is FinishReason.LENGTH and len(out.token_ids) == 63  # up to the context window


async def test_streaming_sends_every_token_once_in_order(fake):
    seen = []
    out = await fake.generate([10], SamplingParams(max_tokens=12), on_tokens=seen.append)
    assert [t for b in seen for t in b] == out.token_ids == list(range(11, 23))
    assert fake._llm.requests[0][2]["output_kind"] == "delta"


async def test_refit_keeps_request_and_marks_versions(fake):
    llm = fake._llm
    llm.hold["r"] = 4
    task = asyncio.create_task(fake.generate([10], SamplingParams(max_tokens=30, seed=5), request_id="r"))
    await until(lambda: llm.produced.get("r") == 4)
    await fake.pause()
    llm.hold.clear()
    for _ in range(50):  # nothing is generated or submitted while paused
        await asyncio.sleep(0)
    assert len(llm.requests) == 1 and not task.done() and fake._active["r"].tokens == [11, 12, 13, 14]
    await fake.update_weights([("w", torch.tensor(1.0))], version=1)  # two buckets
    await fake.update_weights([("w", torch.tensor(2.0))], version=1)
    assert fake.version == 1
    await fake.resume()
    out = await task
    assert out.token_ids == list(range(11, 41)) and out.finish_reason is FinishReason.LENGTH
    assert out.versions == [0] * 4 + [1] * 26
    assert out.logprobs == [0.0] * 4 + [-2.0] * 26  # later tokens come from the new weights
    # vLLM kept the request: no second one, its cache dropped once after loading
    assert len(llm.requests) == 1 and not llm.cancelled and llm.pause_args == ("keep", True)
    assert llm.resets == ["reset running"]
    assert fake.num_requests == 0


async def test_grammar_goes_to_vllms_structured_outputs(fake):
    """vLLM's guidance backend takes the Lark grammar as it is; a refit in the middle continues the grammar."""
    assert fake._llm.args["structured_outputs_config"] == ("config", {"backend": "guidance"})
    llm, schema = fake._llm, {"type": "object"}
    llm.hold["j"] = 4
    task = asyncio.create_task(
        fake.generate([10], SamplingParams(max_tokens=30, grammar=json_grammar(schema)), request_id="j")
    )
    await until(lambda: llm.produced.get("j") == 4)
    assert llm.requests[0][2]["structured_outputs"] == ("params", {"grammar": json_grammar(schema)})
    await refit(fake, 1.0)
    llm.hold.clear()
    assert len((await task).token_ids) == 30


@pytest.mark.parametrize(
    "max_tokens, stop, finish", [(30, [15], FinishReason.STOP), (5, [], FinishReason.LENGTH)]
)
async def test_a_pause_racing_the_last_token_keeps_the_true_finish(fake, max_tokens, stop, finish):
    """Token 15 ends the request (EOS, or the 5th of max_tokens=5) and vLLM samples it as pause() comes in: only
    what was received is kept, so the request ends there once, with its true finish reason; it neither
    generates past EOS nor is continued past max_tokens."""
    llm = fake._llm
    llm.hold["r"] = 4
    task = asyncio.create_task(
        fake.generate([10], SamplingParams(max_tokens=max_tokens, stop_token_ids=stop), request_id="r")
    )
    await until(lambda: llm.produced.get("r") == 4)
    await fake.pause()
    llm.hold.clear()
    await fake.update_weights([("w", torch.tensor(1.0))], version=1)
    await fake.resume()
    out = await asyncio.wait_for(task, 5)
    assert out.token_ids == [11, 12, 13, 14, 15] and out.finish_reason is finish
    assert out.versions == [0, 0, 0, 0, 1] and out.logprobs == [0.0] * 4 + [-1.0]
    assert [p["max_tokens"] for _, _, p in llm.requests] == [max_tokens]


async def test_on_tokens_streams_across_a_refit(fake):
    seen = []
    task = asyncio.create_task(
        fake.generate([10], SamplingParams(max_tokens=12), request_id="s", on_tokens=seen.append)
    )
    await until(lambda: len([t for b in seen for t in b]) >= 3)
    await refit(fake, 1.0)
    out = await task
    assert [t for b in seen for t in b] == out.token_ids == list(range(11, 23))
    assert set(out.versions) == {0, 1}


async def test_weights_load_through_vllms_layerwise_reload(fake):
    """One refit is one vLLM layerwise reload: opened by the first bucket, finished (vLLM's post-load
    processing) once on resume, before the prefix cache is dropped."""
    llm = fake._llm
    await refit(fake, 1.0, 2.0)
    assert (
        llm.loads == ["start", "load", "load", "model config"] and llm.weight == 2.0 and len(llm.resets) == 1
    )
    await refit(fake, 3.0, version=2)  # the next refit opens a new reload
    assert llm.loads[4:] == ["start", "load", "model config"] and fake.version == 2


async def test_abort_while_paused_and_while_running(fake):
    llm = fake._llm
    paused = asyncio.create_task(fake.generate([10], SamplingParams(max_tokens=40), request_id="a"))
    await until(lambda: llm.produced.get("a", 0) > 0)
    await fake.pause()
    await fake.abort("a")  # returns without a resume
    out = await asyncio.wait_for(paused, 5)
    assert out.finish_reason is FinishReason.ABORT and 0 < len(out.token_ids) < 40
    assert out.token_ids == list(range(11, 11 + len(out.token_ids)))
    await fake.resume()
    running = asyncio.create_task(fake.generate([10], SamplingParams(max_tokens=40), request_id="b"))
    await until(lambda: llm.produced.get("b", 0) > 0)
    await fake.abort("b")
    out = await running
    assert out.finish_reason is FinishReason.ABORT and "b" in llm.cancelled
    await fake.abort("unknown")  # a no-op


async def test_cancelling_the_caller_aborts_the_vllm_request(fake):
    task = asyncio.create_task(fake.generate([10], SamplingParams(max_tokens=40), request_id="c"))
    await until(lambda: fake._llm.produced.get("c", 0) > 0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fake._llm.cancelled == ["c"] and fake.num_requests == 0


async def test_bad_requests_raise_engine_error(fake):
    with pytest.raises(RequestError, match="context window"):
        await fake.generate(list(range(64)), SamplingParams())
    with pytest.raises(RequestError, match="prompt token ids"):
        await fake.generate([1000], SamplingParams())
    with pytest.raises(RequestError, match="empty"):
        await fake.generate([], SamplingParams())
    with pytest.raises(RequestError, match="top_p"):
        await fake.generate([1], SamplingParams(top_p=0.0))
    with pytest.raises(EngineError, match="paused"):
        await fake.update_weights([], 1)
    task = asyncio.create_task(fake.generate([10], SamplingParams(max_tokens=40), request_id="d"))
    await until(lambda: "d" in fake._active)
    with pytest.raises(RequestError, match="already in use"):
        await fake.generate([10], SamplingParams(), request_id="d")
    await fake.close()
    assert (await task).finish_reason is FinishReason.ABORT and fake._llm.shut
    with pytest.raises(EngineGone, match="closed"):
        await fake.generate([10], SamplingParams())


async def test_what_vllm_rejects_or_fails_is_an_error(fake, monkeypatch):
    def reject(**kwargs):
        raise ValueError("temperature must be non-negative")

    monkeypatch.setattr(fake._vllm, "SamplingParams", reject)  # vLLM validates when the params are built
    with pytest.raises(RequestError, match="vLLM rejected the request: temperature"):
        await fake.generate([10], SamplingParams())
    monkeypatch.setattr(fake._vllm, "SamplingParams", lambda **kwargs: kwargs)

    async def failed(
        prompt, params, request_id, lora_request=None
    ):  # vLLM's FinishReason.ERROR (e.g. a KV transfer failed)
        yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[], logprobs=None, finish_reason="error")])

    monkeypatch.setattr(fake._llm, "generate", failed)
    with pytest.raises(EngineError, match="vLLM ended the request with finish reason 'error'"):
        await fake.generate([10], SamplingParams())

    async def dead(
        prompt, params, request_id, lora_request=None
    ):  # vLLM's engine core died: a server error, not the request's
        raise RuntimeError("EngineCore encountered an issue")
        yield

    monkeypatch.setattr(fake._llm, "generate", dead)
    with pytest.raises(EngineError, match="vLLM failed the request: RuntimeError"):
        await fake.generate([10], SamplingParams())
    fake._llm.reset_ok = False  # old-weight cache entries would serve new requests
    with pytest.raises(RuntimeError, match="prefix cache"):
        await refit(fake, 1.0)


@pytest.mark.parametrize("arg", ["pipeline_parallel_size", "data_parallel_size"])
def test_parallelism_the_refit_group_cannot_serve_is_refused(arg):
    with pytest.raises(ValueError, match=f"{arg}=2: the refit group"):
        mv.VLLMEngine("/nonexistent", **{arg: 2})
