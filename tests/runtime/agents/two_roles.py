"""Two agents on the stock OpenAI SDK: a planner (named by the model field) and a coder (a client on the coder's
URLs, `ctx.session("coder")`, as a harness given only a base URL would be), each with its own reward."""

from openai import AsyncOpenAI

from molt.agents import ChatAgent, ChatAgentRunner, Result


class TwoRoles(ChatAgent):
    async def run(self, ctx):
        api = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
        plan = await api.chat.completions.create(model="planner", messages=ctx.messages, max_tokens=6)
        step = [{"role": "system", "content": "You carry out plans."}, {"role": "user", "content": "Go."}]
        coder = ctx.session("coder")
        work = await AsyncOpenAI(base_url=coder.base_url, api_key=coder.api_key).chat.completions.create(
            model=ctx.model_name, messages=step, max_tokens=6
        )
        planned, done = plan.choices[0].message.content or "", work.choices[0].message.content or ""
        return Result(reward={"planner": float(len(planned) % 2), "coder": float(len(done) % 3 == 0)})


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(TwoRoles)
