"""Test Env for the inspector: two turns, the second answering a calculator tool result (a `tool` turn of the
chat template), with a pause so that refits land mid-rollout; reward = share of 'e' letters."""
import asyncio

from molt.agents import Env, Result, StepEnvRunner


class CalculatorEnv(Env):
    def __init__(self):
        self.turn = 0

    async def step(self, state):
        self.turn += 1
        text = state["action_text"]
        reward = text.count("e") / max(1, len(text))
        if self.turn == 1:
            await asyncio.sleep(0.2)
            return Result(reward=reward, observation='{"result": 42}', terminated=False)
        return Result(reward=reward, terminated=True)


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(CalculatorEnv, observation_role="tool")
