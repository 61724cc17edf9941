"""The shapes task shared by the recipe's agents: images drawn with Pillow, questions and grading.

Each prompt shows one shape (circle, square or triangle) in a colour on a white 28x28 canvas and asks which
shape it is; the ChatAgents then draw a second image themselves (a "screenshot" of the next step: a square in
a random colour) and ask its colour. Rewards are checked here, never by a model.
"""

from __future__ import annotations

import base64
import io
import random

from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 30), "blue": (30, 60, 220)}
SHAPE_QUESTION = "Which shape is in the image: circle, square or triangle? Answer with one word."
COLOUR_QUESTION = (
    "Here is the next screen. What colour is the square: red, green or blue? Answer with one word."
)


def draw(shape: str, colour: str, size: int = 28) -> bytes:
    """PNG bytes of one filled shape."""
    im = Image.new("RGB", (size, size), "white")
    pen, box = ImageDraw.Draw(im), (4, 4, size - 4, size - 4)
    fill = COLOURS[colour]
    if shape == "circle":
        pen.ellipse(box, fill=fill)
    elif shape == "square":
        pen.rectangle(box, fill=fill)
    else:
        pen.polygon([(size // 2, 3), (size - 3, size - 4), (3, size - 4)], fill=fill)
    out = io.BytesIO()
    im.save(out, format="PNG")
    return out.getvalue()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def grade(reply: str, answer: str, choices) -> float:
    """1.0 when the reply names the answer and no other choice, else 0.0."""
    words = reply.lower()
    return float(answer in words and not any(c in words for c in choices if c != answer))


def next_screen(rng: random.Random) -> tuple[str, bytes]:
    """(colour, PNG) of the second turn's image."""
    colour = rng.choice(sorted(COLOURS))
    return colour, draw("square", colour)
