"""Two agents in one rollout on the stock AsyncOpenAI client, each named by the request's model field: a solver
answers a sum, then a checker judges the solver's answer. Each role has its own reward (the solver: its answer
is right; the checker: its verdict is right), so each role's advantage is its own (docs/algo.md, "Several
agents"). Written against the public agent contract only (`molt.agents`).
"""

import re

from openai import AsyncOpenAI

from molt.agents import ChatAgent, ChatAgentRunner, Result

NUMBER = re.compile(r"-?\d+")


def last_number(text: str) -> int | None:
    found = NUMBER.findall(text)
    return int(found[-1]) if found else None


class SolveAndCheck(ChatAgent):
    async def run(self, ctx):
        api = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
        solved = await api.chat.completions.create(model="solver", messages=ctx.messages)
        answer = solved.choices[0].message.content or ""
        right = last_number(answer) == int(ctx.label)
        claim = (
            f"{ctx.prompt} The answer given is: {answer.strip()[:80]}\nIs that answer right? Reply yes or no."
        )
        checked = await api.chat.completions.create(
            model="checker", messages=[{"role": "user", "content": claim}]
        )
        verdict = (checked.choices[0].message.content or "").strip().lower()
        says_yes, says_no = verdict.startswith("yes"), verdict.startswith("no")
        judged = (says_yes and right) or (says_no and not right)
        return self.reward({"solver": float(right), "checker": float(judged)})

    def reward(self, per_role: dict[str, float]):
        return Result(reward=per_role, info=per_role)


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(SolveAndCheck)
