"""Test Env for evaluation: the score depends on the prompt only (1 for an even label, else 0) and the tool
crashes on labels divisible by 3, so pass@n, avg@n and the failures can be worked out from the data."""

from molt.agents import Env, Result, StepEnvRunner


class LabelEnv(Env):
    async def step(self, state):
        label = int(state["label"])
        if label % 3 == 0:
            raise RuntimeError("the grader crashed")
        return Result(reward=float(label % 2 == 0), terminated=True)


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(LabelEnv)
