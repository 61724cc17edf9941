"""An Env agent file shaped like the reference examples: the framework generates, the Env grades."""

from grading import grade

from molt.agents import Env, Result, StepEnvRunner

SEEN = []  # what step() received, for the test to inspect


class MathEnv(Env):
    async def step(self, state):
        SEEN.append(state)
        observation_text = state["observation_text"]
        action_text = state["action_text"]
        label = state["label"]
        sampling_params = state["sampling_params"]
        assert observation_text and sampling_params.max_tokens
        return Result(reward=grade(action_text, label), terminated=True)


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(MathEnv)
