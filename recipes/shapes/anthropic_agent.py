"""The two-turn shapes agent of `openai_agent.py` on the stock `AsyncAnthropic` client: images go as `image`
blocks with base64 sources (the runner's OpenAI `image_url` parts converted), replies come back as text blocks.
The capture server renders both wires alike, so the segments are the same as with OpenAI.
"""

import base64
import random

from anthropic import AsyncAnthropic
from shapes_task import COLOUR_QUESTION, COLOURS, SHAPES, grade, next_screen

from molt.agents import ChatAgent, ChatAgentRunner, Result


def image_block(png: bytes) -> dict:
    return {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png).decode()},
    }


def to_anthropic(message: dict) -> dict:
    """An OpenAI message from ctx.messages (text or text/image_url parts with data URLs) as Anthropic blocks."""
    content = message["content"]
    if isinstance(content, str):
        return {"role": message["role"], "content": content}
    blocks = [
        {"type": "text", "text": p["text"]}
        if p["type"] == "text"
        else image_block(base64.b64decode(p["image_url"]["url"].split(",", 1)[1]))
        for p in content
    ]
    return {"role": message["role"], "content": blocks}


class AnthropicShapesAgent(ChatAgent):
    async def run(self, ctx):
        client = AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key)
        messages = [to_anthropic(m) for m in ctx.messages]

        async def ask():
            reply = await client.messages.create(
                model=ctx.model_name, messages=messages, max_tokens=ctx.sampling_params.max_tokens
            )
            return "".join(b.text for b in reply.content if b.type == "text")

        shape_text = await ask()
        colour, png = next_screen(random.Random(ctx.session_id))
        messages += [
            {"role": "assistant", "content": shape_text},
            {"role": "user", "content": [image_block(png), {"type": "text", "text": COLOUR_QUESTION}]},
        ]
        shape, hue = grade(shape_text, ctx.label, SHAPES), grade(await ask(), colour, COLOURS)
        return Result(reward=(shape + hue) / 2, info={"shape_correct": shape, "colour_correct": hue})


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(AnthropicShapesAgent)
