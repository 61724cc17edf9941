"""The same two agents with one reward for the rollout (the mean of the two roles' successes), broadcast to
both: what per-role credit is measured against (docs/benchmarks.md)."""

from agent import SolveAndCheck  # the agent file's folder is on sys.path (molt.agents.loader)

from molt.agents import ChatAgentRunner, Result


class Broadcast(SolveAndCheck):
    def reward(self, per_role):
        return Result(reward=sum(per_role.values()) / len(per_role), info=per_role)


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(Broadcast)
