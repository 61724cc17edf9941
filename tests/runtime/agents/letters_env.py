"""Test Env: two turns with a pause between them (so refits land mid-rollout); reward = share of 'e' letters."""

import asyncio
import random

from molt.agents import Env, Result, StepEnvRunner


class LettersEnv(Env):
    fail_rate = 0.0  # share of episodes whose tool raises
    hang_rate = 0.0  # share of episodes that hang until the runner's timeout

    def __init__(self):
        self.turn = 0

    async def step(self, state):
        self.turn += 1
        roll = random.random()
        if roll < self.fail_rate:
            raise RuntimeError("the tool crashed")
        if roll < self.fail_rate + self.hang_rate:
            await asyncio.sleep(3600)  # hangs: the runner's timeout must catch it
        text = state["action_text"]
        reward = text.count("e") / max(1, len(text))
        if self.turn == 1:
            await asyncio.sleep(0.2)
            return Result(reward=reward, observation="Again, with more e.", terminated=False)
        return Result(reward=reward, terminated=True)


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(LettersEnv)
