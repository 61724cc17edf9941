"""The same capture path through a stock AsyncAnthropic client (reference example 3.2)."""

from anthropic import AsyncAnthropic
from grading import grade

from molt.agents import ChatAgent, ChatAgentRunner, Result


class MyAgent(ChatAgent):
    async def run(self, ctx):
        client = AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key)
        response = await client.messages.create(
            model=ctx.model_name,
            messages=[{"role": "user", "content": ctx.prompt}],
            max_tokens=ctx.sampling_params.max_tokens,
        )
        text = response.content[0].text
        return Result(reward=[grade(text, ctx.label)])


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(MyAgent)
