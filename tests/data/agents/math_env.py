"""A math Env written the way the reference's examples are: the framework generates, step() grades the whole
text (observation_text + action_text) and returns a torch-tensor reward."""

import torch
from math_grader import compute_score

from molt.agents import Env, Result, StepEnvRunner


class MathEnv(Env):
    async def reset(self, state):
        return state

    async def step(self, state):
        text = state["observation_text"] + state["action_text"]
        reward = compute_score(text, state["label"])
        return Result(
            reward=torch.tensor([reward]),
            terminated=True,
            info={"response_length": torch.tensor(len(state["action_text"]))},
        )


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(MathEnv)
