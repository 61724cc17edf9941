"""Test ChatAgent in the shape of the reference examples, on the stock AsyncOpenAI client."""

import torch
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from molt.agents import ChatAgent, ChatAgentRunner, Result


class SDKAgent(ChatAgent):
    wire = "openai"

    async def run(self, ctx):
        if self.wire == "anthropic":
            client = AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key)
            response = await client.messages.create(
                model=ctx.model_name,
                messages=[{"role": "user", "content": ctx.prompt}],
                max_tokens=ctx.sampling_params.max_tokens,
            )
            text = response.content[0].text if response.content else ""
        else:
            client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
            response = await client.chat.completions.create(
                model=ctx.model_name,
                messages=list(ctx.messages),
                max_tokens=ctx.sampling_params.max_tokens,
                temperature=ctx.sampling_params.temperature,
            )
            text = response.choices[0].message.content or ""
        return Result(reward=torch.tensor([text.count("e") / max(1, len(text))]))


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(SDKAgent)
