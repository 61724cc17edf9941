"""A stand-in for vLLM's `AsyncLLM` (vLLM has no CPU build) for the engine tests of `molt.engine.vllm`, as unkind
as the real one where Molt relies on it."""

import asyncio
from types import SimpleNamespace

from molt.engine import vllm_worker as vw


def lp(logprob, rank):
    return SimpleNamespace(logprob=logprob, rank=rank)  # shaped like vllm.logprobs.Logprob


def fake_reload(monkeypatch):
    """vLLM's layerwise reload, recorded in the model's `loads` ("start", then the config it finished with)."""

    def start(model):
        model.loads.append("start")

    def finish(model, config):
        model.loads.append(config)

    monkeypatch.setattr(vw, "layerwise_reload", lambda: (start, finish))


class FakeAsyncLLM:
    """vLLM's AsyncLLM with `pause_generation(mode="keep")` / `resume_generation()` (vllm/v1/engine/async_llm.py
    and core.py): paused requests stay in the engine and continue on resume. After token t comes t + 1, one token
    per event-loop turn, with log-prob minus the weight loaded last (so a test can tell which weights produced a
    token); loading goes through the real `WorkerExtension` (with `fake_reload`). Like vLLM
    (vllm/v1/engine/output_processor.py, detokenize=False): cumulative outputs, the default RequestOutputKind,
    hand back the same token_ids and logprobs lists each time and grow them in place, DELTA outputs hold only the
    new tokens. `hold[request_id] = n` stalls a request after n tokens, so that a test can pause at an exact
    point."""

    def __init__(self, args):
        self.args, self.weight, self.requests, self.cancelled, self.resets = args, 0.0, [], [], []
        self.paused, self.reset_ok, self.hold, self.produced = False, True, {}, {}
        self.model_config = SimpleNamespace(max_model_len=64, get_vocab_size=lambda: 1000)
        self.loads = []  # what reached the model, in order: "load", or the layerwise reload's calls
        model = SimpleNamespace(load_weights=self._load, loads=self.loads)
        self.worker = type("Worker", (vw.WorkerExtension,), {})()
        self.worker.model_runner, self.worker.device = SimpleNamespace(model=model), "cpu"
        self.worker.model_config = "model config"

    @classmethod
    def from_engine_args(cls, args):
        return cls(args)

    def _load(self, weights):
        self.loads.append("load")
        for _, t in weights:
            self.weight = float(t)

    async def generate(self, prompt, params, request_id, lora_request=None):
        assert lora_request is None  # a LoRA per role runs on real vLLM only (tests/engine/test_vllm_lora.py)
        ids = list(prompt["prompt_token_ids"])
        self.requests.append((request_id, ids, params))
        delta, tokens, logprobs, sent, done = params.get("output_kind") == "delta", [], [], 0, None
        try:
            while done is None:
                await asyncio.sleep(0)
                if self.paused or self.hold.get(request_id) == len(tokens):
                    continue
                t = (tokens or ids)[-1] + 1
                tokens.append(t)
                logprobs.append({t: lp(-self.weight, 1)})
                self.produced[request_id] = len(tokens)
                stop = t in params["stop_token_ids"] and len(tokens) >= params["min_tokens"]
                done = "stop" if stop else "length" if len(tokens) == params["max_tokens"] else None
                new = (tokens[sent:], logprobs[sent:]) if delta else (tokens, logprobs)
                sent = len(tokens)
                out = SimpleNamespace(token_ids=new[0], logprobs=new[1], finish_reason=done)
                yield SimpleNamespace(outputs=[out])
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise

    async def pause_generation(self, *, mode="abort", clear_cache=True):
        assert mode == "keep"
        self.paused, self.pause_args = True, (mode, clear_cache)

    async def resume_generation(self):
        self.paused = False

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    async def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.resets.append("reset running" if reset_running_requests else "reset")
        return self.reset_ok

    def shutdown(self):
        self.shut = True
