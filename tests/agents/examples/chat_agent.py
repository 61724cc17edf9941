"""An agent file shaped like the reference examples: a ChatAgent on a stock AsyncOpenAI client."""

import torch
from grading import grade
from openai import AsyncOpenAI

from molt.agents import ChatAgent, ChatAgentRunner, Result


class MyAgent(ChatAgent):
    async def run(self, ctx):
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
        response = await client.chat.completions.create(
            model=ctx.model_name,
            messages=list(ctx.messages),
            max_tokens=ctx.sampling_params.max_tokens,
            temperature=ctx.sampling_params.temperature,
        )
        text = response.choices[0].message.content
        return Result(reward=torch.tensor([grade(text, ctx.label)]), info={"length": torch.tensor(len(text))})


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(MyAgent)
