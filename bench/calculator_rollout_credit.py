"""The agentic demo's agent with the rollout's reward on every token (`step_credit = False`): no turn rewards, as
the recipe was before. Run: `molt demo --agent --train.agent_path bench/calculator_rollout_credit.py`; the
comparison is in docs/benchmarks.md, "The agentic demo and the seed of each model call"."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes/calculator"))

from agent import CalculatorAgent  # the recipe's folder, on sys.path above

from molt.agents import ChatAgentRunner


class RolloutCreditAgent(CalculatorAgent):
    step_credit = False


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(RolloutCreditAgent)
