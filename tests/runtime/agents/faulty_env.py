"""Test Env: LettersEnv where 20% of episodes raise and 10% hang past the rollout timeout."""
from letters_env import LettersEnv

from molt.agents import StepEnvRunner


class FaultyEnv(LettersEnv):
    fail_rate = 0.2
    hang_rate = 0.1


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(FaultyEnv)
