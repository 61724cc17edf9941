"""Test Env: LettersEnv whose tool crashes on prompts with label % 7 == 0 and hangs past the rollout timeout on
label % 7 == 1, every time, so what the pool counts can be worked out from the data (test_train_e2e)."""

import asyncio

from letters_env import LettersEnv

from molt.agents import StepEnvRunner


def fault(label) -> str | None:
    return {0: "agent_error", 1: "timeout"}.get(int(label) % 7)


class FaultyEnv(LettersEnv):
    async def step(self, state):
        kind = fault(state["label"])
        if kind == "agent_error":
            raise RuntimeError("the tool crashed")
        if kind == "timeout":
            await asyncio.sleep(3600)  # the runner's timeout must catch it
        return await super().step(state)


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(FaultyEnv)
