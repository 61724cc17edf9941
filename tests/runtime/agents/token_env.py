"""Test Env: one turn; reward = how often the reply contains the letter 'Q', which only one token of the tiny
model's vocabulary contains (`molt.testing`'s byte-level BPE has no merge with it): a reward for one token."""

from molt.agents import Env, Result, StepEnvRunner


class TokenEnv(Env):
    async def step(self, state):
        return Result(reward=float(state["action_text"].count("Q")), terminated=True)


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(TokenEnv)
