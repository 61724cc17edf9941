"""A rollout worker (in-process, a scripted engine) seeds each model call of a rollout from the task's seed:
a ChatAgent asking the same question twice gets two streams, training and evaluation rollouts alike, and the
same streams when the task runs again."""

from openai import AsyncOpenAI

from molt.agents import ChatAgent, ChatAgentRunner, Result
from molt.capture.render import ChatRenderer
from molt.capture.server import CaptureServer
from molt.runtime.pool import RolloutTask
from molt.runtime.worker import RefitGate, RolloutWorker
from molt.testing.scripted import ScriptedEngine
from molt.types import SamplingParams


class AskTwice(ChatAgent):
    async def run(self, ctx):
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
        for _ in range(2):
            await client.chat.completions.create(model=ctx.model_name, messages=list(ctx.messages))
        return Result(reward=1.0)


async def test_each_call_of_a_worker_rollout_has_its_own_seed(tokenizer):
    engine = ScriptedEngine(tokenizer, ["x"])
    worker = RolloutWorker("unused", "unused")
    worker.engine = RefitGate(engine)
    worker.server, worker.runner = (
        CaptureServer(worker.engine, ChatRenderer(tokenizer)),
        ChatAgentRunner(AskTwice),
    )
    await worker.server.start()
    try:
        for train in (True, False, True):
            task = RolloutTask({"prompt": "hi"}, (0, 0), "g", "g-s0-a0", 0, seed=11)
            outcome, *_ = [item async for item in worker.run(task, SamplingParams(max_tokens=4), train)]
            assert outcome.status.value == "ok"
    finally:
        await worker.server.stop()
    seeds = [c["params"].seed for c in engine.calls]
    assert None not in seeds and seeds[0] != seeds[1] and seeds == seeds[:2] * 3
