"""Images drawn with Pillow for the vision tests, as PNG bytes, data URLs and OpenAI / Anthropic content."""
from __future__ import annotations

import base64
import io

from PIL import Image, ImageDraw

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
