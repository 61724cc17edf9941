"""Two agents on the stock OpenAI SDK: a planner (named by the model field) and a coder (a client on the coder's
URLs, `ctx.session("coder")`, as a harness given only a base URL would be) that works two turns. Each role has
its own reward, and each turn its own (`Result.turn_rewards`: the planner's call, then the coder's two)."""

from openai import AsyncOpenAI

from molt.agents import ChatAgent, ChatAgentRunner, Result


class TwoRoles(ChatAgent):
    async def run(self, ctx):
        api = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
        plan = await api.chat.completions.create(model="planner", messages=ctx.messages, max_tokens=6)
        coder = AsyncOpenAI(base_url=ctx.session("coder").base_url, api_key=ctx.api_key)
        step = [{"role": "system", "content": "You carry out plans."}, {"role": "user", "content": "Go."}]
        done = []
        for _ in range(2):
            work = await coder.chat.completions.create(model=ctx.model_name, messages=step, max_tokens=6)
            done.append(float(len(work.choices[0].message.content or "") % 3 == 0))
            step += [
                {"role": "assistant", "content": work.choices[0].message.content},
                {"role": "user", "content": "More."},
            ]
        planned = float(len(plan.choices[0].message.content or "") % 2)
        return Result(reward={"planner": planned, "coder": sum(done)}, turn_rewards=[planned, *done])


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(TwoRoles)
