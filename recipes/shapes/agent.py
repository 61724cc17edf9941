"""The shapes task as a Molt `Env`: the framework shows the row's image and generates; the env grades the shape.

The row's images reach the model through the first user message (the runner inlines them) and `reset` gets
them too, as the public contract's `images`.
"""

from shapes_task import SHAPES, grade

from molt.agents import Env, Result, StepEnvRunner


class ShapeEnv(Env):
    async def reset(self, state):
        assert state["images"], "the row's image reaches the env"

    async def step(self, state):
        reward = grade(state["action_text"], state["label"], SHAPES)
        return Result(reward=reward, terminated=True, info={"correct": reward})


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(ShapeEnv)
