"""Images drawn with Pillow for the vision tests, as PNG bytes, data URLs and OpenAI / Anthropic content, and
two-turn rollouts through the capture server."""
from __future__ import annotations

import asyncio
import base64
import io

from openai import AsyncOpenAI
from PIL import Image, ImageDraw

from molt.testing.scripted import live_capture_server
from molt.types import SamplingParams

IMAGE_TOKENS = 4  # the tiny LLaVA: 28x28 pixels in 14-pixel patches


def png(color: str = "red", shape: str = "circle", size: tuple[int, int] = (32, 32)) -> bytes:
    im = Image.new("RGB", size, "white")
    box = (4, 4, size[0] - 4, size[1] - 4)
    draw = ImageDraw.Draw(im)
    draw.ellipse(box, fill=color) if shape == "circle" else draw.rectangle(box, fill=color)
    buffer = io.BytesIO()
    im.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def user(text: str, *images: bytes) -> dict:
    """An OpenAI user message: the images, then the text."""
    parts = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def anthropic_user(text: str, *images: bytes) -> dict:
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": base64.b64encode(i).decode()}} for i in images]
    return {"role": "user", "content": [*blocks, {"type": "text", "text": text}]}


async def two_turn_rollouts(engine, renderer, colours):
    """One two-turn rollout per colour (an image each turn, the OpenAI SDK) through the capture server, all at
    once (so the engine batches them): their segments."""
    async with live_capture_server(engine, renderer) as server:
        async def rollout(i, colour):
            session = await server.open_session(f"r{i}", SamplingParams(max_tokens=6, temperature=0.7, seed=i))
            api = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key)
            messages = [user("What is this?", png(colour))]
            text = (await api.chat.completions.create(model="m", messages=messages)).choices[0].message.content
            messages += [{"role": "assistant", "content": text}, user("And this?", png(colour, "square"))]
            await api.chat.completions.create(model="m", messages=messages)
            (segment,) = await session.close()
            return segment

        return list(await asyncio.gather(*(rollout(i, c) for i, c in enumerate(colours))))
