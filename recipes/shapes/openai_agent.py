"""The shapes task as a two-turn `ChatAgent` on the stock `AsyncOpenAI` client: the dataset's image (inlined into
`ctx.messages` by the runner as an `image_url` part) and a shape question, then a second image the agent draws
itself (the next "screenshot") and a colour question. The conversation grows, so capture keeps one segment
holding both images. Reward: the mean of the two answers' grades.
"""

import random

from openai import AsyncOpenAI
from shapes_task import COLOUR_QUESTION, COLOURS, SHAPES, data_url, grade, next_screen

from molt.agents import ChatAgent, ChatAgentRunner, Result


class ShapesAgent(ChatAgent):
    async def run(self, ctx):
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
        p = ctx.sampling_params
        messages = list(ctx.messages)
        first = await client.chat.completions.create(
            model=ctx.model_name, messages=messages, max_tokens=p.max_tokens, temperature=p.temperature
        )
        shape_text = first.choices[0].message.content or ""
        colour, png = next_screen(random.Random(ctx.session_id))
        messages += [
            {"role": "assistant", "content": shape_text},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(png)}},
                    {"type": "text", "text": COLOUR_QUESTION},
                ],
            },
        ]
        second = await client.chat.completions.create(
            model=ctx.model_name, messages=messages, max_tokens=p.max_tokens, temperature=p.temperature
        )
        shape, hue = (
            grade(shape_text, ctx.label, SHAPES),
            grade(second.choices[0].message.content or "", colour, COLOURS),
        )
        return Result(reward=(shape + hue) / 2, info={"shape_correct": shape, "colour_correct": hue})


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(ShapesAgent)
