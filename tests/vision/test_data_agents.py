"""Images from the dataset to the agents: `--data.image_key` / `--data.max_images_per_prompt`, the runners
inlining a row's images into `ctx.messages` as OpenAI `image_url` parts, a two-turn ChatAgent sending an image
each turn (one segment, both images), and an Env whose steps return images for the next observation."""

import base64
import io
import json

import pytest
import torch
from openai import AsyncOpenAI
from PIL import Image
from vision_helpers import data_url, png, user

from molt.agents import ChatAgent, ChatAgentRunner, Env, Result, StepEnvRunner
from molt.agents.runners import image_part, row_messages
from molt.runtime.data import load_prompts
from molt.testing.scripted import live_capture_server
from molt.types import SamplingParams

RED = png("red")


def test_load_prompts_images(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [{"q": "one", "pics": "a.png"}, {"q": "two", "pics": ["a.png", "b.png"]}, {"q": "none"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = load_prompts(str(path), input_key="q", label_key=None, tools_key=None, image_key="pics")
    assert [r.get("images") for r in out] == [["a.png"], ["a.png", "b.png"], None]
    assert "images" not in load_prompts(str(path), input_key="q", label_key=None, tools_key=None)[0]
    with pytest.raises(ValueError, match=r"row 1 has 2 images, more than data.max_images_per_prompt=1"):
        load_prompts(str(path), input_key="q", label_key=None, tools_key=None, image_key="pics", max_images=1)


def test_image_parts_from_every_kind_of_dataset_image(tmp_path):
    (tmp_path / "red.png").write_bytes(RED)
    url = data_url(RED)
    pil = Image.open(io.BytesIO(RED))
    for image in (
        str(tmp_path / "red.png"),
        f"file://{tmp_path / 'red.png'}",
        RED,
        {"bytes": RED, "path": None},
        {"bytes": None, "path": str(tmp_path / "red.png")},
        url,
    ):
        assert image_part(image) == {"type": "image_url", "image_url": {"url": url}}
    decoded = base64.b64decode(
        image_part(pil)["image_url"]["url"].split(",", 1)[1]
    )  # re-encoded: same pixels
    assert Image.open(io.BytesIO(decoded)).tobytes() == pil.convert("RGB").tobytes()
    assert image_part("https://example.com/x.png")["image_url"]["url"] == "https://example.com/x.png"
    messages, prompt = row_messages(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is it?"},
            ],
            "images": [RED],
        }
    )
    assert prompt == "What is it?" and messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[1]["content"] == [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What is it?"},
    ]
    assert row_messages({"prompt": "hi"})[0] == [{"role": "user", "content": "hi"}]  # no images: unchanged


class TwoScreens(ChatAgent):
    """Sends the row's image (inlined by the runner), then a screenshot of its own."""

    async def run(self, ctx):
        api = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
        messages = list(ctx.messages)
        reply = await api.chat.completions.create(model=ctx.model_name, messages=messages, max_tokens=5)
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            user("And now?", png("green", "square")),
        ]
        await api.chat.completions.create(model=ctx.model_name, messages=messages, max_tokens=5)
        return Result(reward=1.0)


class Screens(Env):
    """Each step answers with a new screenshot as the next observation; two turns."""

    seen = None

    async def reset(self, state):
        Screens.seen = state["images"]

    async def step(self, state):
        return (
            Result(reward=0.5, terminated=False, observation="Next screen.", images=[png("blue")])
            if "Next screen" not in state["observation_text"]
            else Result(reward=0.5)
        )


async def test_two_turn_agent_and_env_keep_one_segment_with_both_images(vlm_engine, vlm_renderer):
    """Unseeded, so also over whatever the tiny random model samples: the engine never samples the image token
    (which would make the next turn's prompt hold 9 placeholders for 8 images' features), so every seed works."""
    image_id = vlm_renderer.processor.image_token_id
    row = {"prompt": "What is in the image?", "images": [RED]}
    async with live_capture_server(vlm_engine, vlm_renderer) as server:
        for _ in range(3):
            agent = await ChatAgentRunner(TwoScreens).run(
                row, sessions=server, rollout_id="a", sampling_params=SamplingParams(max_tokens=5)
            )
            env = await StepEnvRunner(Screens).run(
                row, sessions=server, rollout_id="e", sampling_params=SamplingParams(max_tokens=5)
            )
            for traj in (agent, env):
                assert traj.ok, traj.error
                (segment,) = traj.segments
                assert (segment.token_ids == image_id).sum() == 8 and segment.images["pixel_values"].shape[
                    0
                ] == 2
                assert image_id not in segment.token_ids[segment.action_mask]
    assert env.reward == 1.0 and Screens.seen == [RED]
    red = vlm_renderer.encode_images("<image>", [vlm_renderer.image(data_url(RED))])[1]["pixel_values"]
    assert torch.equal(agent.segments[0].images["pixel_values"][:1], red)
    assert torch.equal(env.segments[0].images["pixel_values"][:1], red)
