"""Bench Env: each episode waits a tool latency drawn from a seeded distribution, then grades like the math env."""

import asyncio
import os
import random
import zlib

from molt.agents import Env, Result, StepEnvRunner

MEAN = float(os.environ.get("MOLT_BENCH_TOOL_LATENCY", "1.0"))


class LatencyEnv(Env):
    async def step(self, state):
        # seeded by the action itself: the same run draws the same latencies, spread over [0.5, 1.5] x MEAN
        rng = random.Random(zlib.crc32(state["action_text"].encode()))
        await asyncio.sleep(MEAN * rng.uniform(0.5, 1.5))
        return Result(reward=state["action_text"].count("e") / max(1, len(state["action_text"])))


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(LatencyEnv)
