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
    blocks = [
        {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(i).decode()},
        }
        for i in images
    ]
    return {"role": "user", "content": [*blocks, {"type": "text", "text": text}]}


async def two_turn_rollouts(engine, renderer, colours):
    """One two-turn rollout per colour (an image each turn, the OpenAI SDK) through the capture server, all at
    once (so the engine batches them): their segments."""
    async with live_capture_server(engine, renderer) as server:

        async def rollout(i, colour):
            session = await server.open_session(
                f"r{i}", SamplingParams(max_tokens=6, temperature=0.7, seed=i)
            )
            api = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key)
            messages = [user("What is this?", png(colour))]
            text = (
                (await api.chat.completions.create(model="m", messages=messages)).choices[0].message.content
            )
            messages += [{"role": "assistant", "content": text}, user("And this?", png(colour, "square"))]
            await api.chat.completions.create(model="m", messages=messages)
            (segment,) = await session.close()
            return segment

        return list(await asyncio.gather(*(rollout(i, c) for i, c in enumerate(colours))))


def image_window(model_dir, kinds: str, seed: int = 0) -> list:
    """One experience per letter of `kinds` on the tiny LLaVA: "i" a prompt with a Pillow image (its 4 image
    tokens and pixel values from the checkpoint's processor), "t" text only; random replies, behavior log-probs
    and advantages (the same on every process for the same seed)."""
    import random

    from transformers import AutoProcessor

    from molt.types import Experience

    processor, rng = AutoProcessor.from_pretrained(str(model_dir)), random.Random(seed)
    out = []
    for i, kind in enumerate(kinds):
        if kind == "i":
            from PIL import Image

            image = Image.open(
                io.BytesIO(png(rng.choice(["red", "blue", "green"]), rng.choice(["circle", "sq"])))
            )
            inputs = processor(text=f"<image>Look {i}", images=[image], return_tensors="pt")
            prompt, images = inputs["input_ids"][0].tolist(), {"pixel_values": inputs["pixel_values"]}
        else:
            prompt, images = [rng.randrange(10, 300) for _ in range(rng.randint(3, 9))], None
        reply = [rng.randrange(10, 300) for _ in range(rng.randint(3, 8))]
        mask = [0] * len(prompt) + [1] * len(reply)
        out.append(
            Experience(
                rollout_id=f"r{i}",
                group_id="g",
                segment_index=0,
                reward=0.0,
                num_tokens=len(mask),
                num_actions=len(reply),
                min_version=0,
                temperature=rng.choice([1.0, 0.7]),
                token_ids=prompt + reply,
                action_mask=mask,
                behavior_logprobs=[rng.uniform(-7.0, -5.0) * m for m in mask],
                versions=[0 if m else -1 for m in mask],
                advantages=[rng.gauss(0.0, 1.0) * m for m in mask],
                images=images,
            )
        )
    return out


FSDP_WINDOW, FSDP_SHARES = "itiiii", ([0, 1], [2, 3, 4, 5])  # rank 0: an image, a text row, then a ghost
FSDP_CFG = {
    "fsdp.device": "cpu",
    "actor.dtype": "float32",
    "train.micro_batch_size": 1,
    "train.max_tokens_per_gpu": 0,
    "actor.adam.lr": 1e-3,
    "actor.max_norm": 1.0,
    "critic.adam.lr": 1e-3,
}


def fsdp_run(model_dir, rank: int | None = None) -> dict:
    """Log-probs, one actor step, and (gae) values and two critic steps on FSDP_WINDOW: the whole window in one
    process (rank None), or this rank's share."""

    from molt.trainer import Actor, Critic

    window = image_window(model_dir, FSDP_WINDOW)
    exps = window if rank is None else [window[i] for i in FSDP_SHARES[rank]]
    # Adam's first update is lr * g / (|g| + eps): with lr = eps = 1 the parameters move by g / (|g| + 1), so
    # comparing them compares the gradients (with a small eps, rounding noise in a near-zero g would be scaled up)
    actor = Actor.from_pretrained(str(model_dir), **{**FSDP_CFG, "actor.adam.lr": 1.0, "actor.adam.eps": 1.0})
    # lists: torch.load (weights only) refuses numpy arrays
    out = {"logprobs": [x.tolist() for x in actor.compute_logprobs(exps)], "metrics": actor.train_step(exps)}
    out["params"] = {n: t.clone() for b in actor.iter_weights(bucket_bytes=64 << 10) for n, t in b}
    critic = Critic.from_pretrained(str(model_dir), **FSDP_CFG)
    returns = [[float(m) for m in e.action_mask] for e in exps]
    for _ in range(2):
        old = critic.compute_values(exps)
        out["critic"] = critic.train_step(exps, returns, old)
    out["values"] = [x.tolist() for x in critic.compute_values(exps)]
    out["value_head"] = sum(
        float((p.full_tensor() if hasattr(p, "full_tensor") else p).detach().abs().sum())
        for p in critic.model.value_head.parameters()
    )
    return out


def fsdp_worker(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    import os

    import torch

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    torch.save(fsdp_run(model_dir, rank), f"{out_dir}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


def offload(exp):
    """`exp` with its payload in this node's object store, as a trainer rank receives it."""
    import ray

    exp.payload_ref = ray.put(exp.split())
    return exp
