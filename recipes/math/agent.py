"""Single-turn arithmetic as a Molt `Env`: the framework generates, the env grades the last number of the reply.

Written against the public agent contract only (`molt.agents`), so it runs unchanged on any Molt.
"""

import re

from molt.agents import Env, Result, StepEnvRunner

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def grade(text: str, label) -> float:
    """1.0 when the last number in the reply equals the label, else 0.0."""
    numbers = NUMBER.findall(text.replace(",", ""))
    if not numbers:
        return 0.0
    try:
        return float(abs(float(numbers[-1]) - float(label)) < 1e-6)
    except ValueError:
        return 0.0


class MathEnv(Env):
    async def step(self, state):
        reward = grade(state["action_text"], state["label"])
        return Result(reward=reward, terminated=True, info={"correct": reward})


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(MathEnv)
