"""Images through the capture server on both wires (the official SDKs, the tiny LLaVA and its real engine): the
prompt is exactly what Hugging Face's own processor makes of the conversation, a segment keeps each image once
across turns (resent images recognised), a compaction that drops old screenshots starts a new segment, and bad
images are 400s that leave the server serving."""

import io

import anthropic
import httpx
import numpy as np
import pytest
import torch
from openai import AsyncOpenAI, BadRequestError
from PIL import Image
from vision_helpers import IMAGE_TOKENS, anthropic_user, data_url, png, user

from molt.capture.render import ChatRenderer
from molt.testing.scripted import RecordingEngine, ScriptedEngine, live_capture_server
from molt.types import SamplingParams

RED, BLUE = png("red"), png("blue", "square")


def reference(processor, messages):
    """(input ids, pixel values) by transformers' own multimodal chat path: the processor's apply_chat_template
    with the decoded images in the messages."""

    def part(p):
        if p["type"] == "text":
            return p
        return {"type": "image", "image": Image.open(io.BytesIO(p["_bytes"])).convert("RGB")}

    msgs = [
        {**m, "content": [part(p) for p in m["content"]] if isinstance(m["content"], list) else m["content"]}
        for m in messages
    ]
    out = processor.apply_chat_template(
        msgs, tokenize=True, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    return out["input_ids"][0].tolist(), out["pixel_values"]


def ref_user(text, *images):  # the same message as `user`, keeping the bytes for `reference`
    return {
        "role": "user",
        "content": [*({"type": "image", "_bytes": i} for i in images), {"type": "text", "text": text}],
    }


async def test_openai_turns_keep_one_segment_with_each_image_once(vlm_engine, vlm_renderer):
    engine = RecordingEngine(vlm_engine)
    image_id = vlm_renderer.processor.image_token_id
    async with live_capture_server(engine, vlm_renderer) as server:
        session = await server.open_session("r0", SamplingParams(max_tokens=6, seed=1))
        api = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key)
        messages = [user("What is this?", RED)]
        first = (await api.chat.completions.create(model="m", messages=messages)).choices[0].message.content
        messages += [{"role": "assistant", "content": first}, user("And this?", BLUE)]
        await api.chat.completions.create(model="m", messages=messages)
        # a compaction: the agent keeps only the latest screenshot
        await api.chat.completions.create(model="m", messages=[user("Once more: and this?", BLUE)])
        segments = await session.close()
    assert [s.break_reason for s in segments] == ["start", "compaction"]
    (p1, c1), (p2, c2), (p3, c3) = [(p, c) for _, p, c in engine.records]
    ids, pixels = reference(vlm_renderer.processor, [ref_user("What is this?", RED)])
    assert p1 == ids and p1.count(image_id) == IMAGE_TOKENS
    assert p2[: len(p1) + len(c1.token_ids)] == p1 + c1.token_ids  # continued token-exactly
    seg = segments[0]
    assert (
        seg.token_ids.tolist() == p2 + c2.token_ids and (seg.token_ids == image_id).sum() == 2 * IMAGE_TOKENS
    )
    _, both = reference(vlm_renderer.processor, [ref_user("What is this?", RED, BLUE)])
    assert torch.equal(seg.images["pixel_values"], both) and torch.equal(both[:1], pixels)
    assert (
        segments[1].token_ids.tolist() == p3 + c3.token_ids
        and segments[1].images["pixel_values"].shape[0] == 1
    )
    assert torch.equal(segments[1].images["pixel_values"], both[1:])


async def test_both_wires_capture_the_same_tokens_and_images(vlm_engine, vlm_renderer):
    """The same conversation sent through the Anthropic SDK (image blocks with base64 sources) and the OpenAI SDK
    (image_url data URLs), with the same seed: identical prompts, replies and segments."""
    segments = {}
    async with live_capture_server(vlm_engine, vlm_renderer) as server:
        for wire in ("openai", "anthropic"):
            session = await server.open_session(wire, SamplingParams(max_tokens=6, seed=5))
            if wire == "openai":
                api = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key)
                messages = [user("Shape?", RED)]
                text = (
                    (await api.chat.completions.create(model="m", messages=messages))
                    .choices[0]
                    .message.content
                )
                messages += [{"role": "assistant", "content": text}, user("Colour?", BLUE)]
                await api.chat.completions.create(model="m", messages=messages)
            else:
                api = anthropic.AsyncAnthropic(base_url=session.session_url, api_key=session.api_key)
                messages = [anthropic_user("Shape?", RED)]
                reply = await api.messages.create(model="m", max_tokens=6, messages=messages)
                messages += [
                    {"role": "assistant", "content": reply.content[0].text if reply.content else ""},
                    anthropic_user("Colour?", BLUE),
                ]
                await api.messages.create(model="m", max_tokens=6, messages=messages)
            segments[wire] = await session.close()
    (a,), (b,) = segments["openai"], segments["anthropic"]
    assert np.array_equal(a.token_ids, b.token_ids) and np.array_equal(a.action_mask, b.action_mask)
    np.testing.assert_allclose(a.behavior_logprobs, b.behavior_logprobs, atol=1e-6)
    assert (
        torch.equal(a.images["pixel_values"], b.images["pixel_values"])
        and a.images["pixel_values"].shape[0] == 2
    )


BAD = {
    "bad base64": ("data:image/png;base64,@@not-base64@@", "base64 data is malformed"),
    "truncated png": (data_url(png(size=(30, 30))[:70]), "cannot be decoded"),
    "not an image": (data_url(b"hello, world"), "cannot be decoded"),
    "too many pixels": (data_url(png(size=(40, 40))), "over the limit of 1000 pixels"),
    "remote url": ("https://example.com/cat.png", "remote URLs are refused"),
    "file url": ("file:///etc/passwd", "must be a base64 data URL"),
}


async def test_bad_images_are_400s_and_the_server_keeps_serving(vlm_engine, tiny_vlm_dir):
    renderer = ChatRenderer.from_pretrained(str(tiny_vlm_dir), max_image_pixels=1000)
    ok = user("What is this?", png(size=(30, 30)))  # 900 pixels
    async with live_capture_server(vlm_engine, renderer) as server:
        session = await server.open_session("r", SamplingParams(max_tokens=3))
        api = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        for name, (url, message) in BAD.items():
            bad = {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "What is this?"},
                ],
            }
            with pytest.raises(BadRequestError) as caught:
                await api.chat.completions.create(model="m", messages=[bad])
            assert message in caught.value.message, name
        claude = anthropic.AsyncAnthropic(
            base_url=session.session_url, api_key=session.api_key, max_retries=0
        )
        block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "%%%"}}
        with pytest.raises(anthropic.BadRequestError, match="base64 data is malformed"):
            await claude.messages.create(
                model="m", max_tokens=3, messages=[{"role": "user", "content": [block]}]
            )
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"{server.url}/health")).json()["status"] == "ok"
        reply = await api.chat.completions.create(model="m", messages=[ok])  # still serving
        (segment,) = await session.close()
    assert (
        reply.choices[0].finish_reason in ("stop", "length") and segment.images["pixel_values"].shape[0] == 1
    )


async def test_a_text_model_refuses_images(tokenizer):
    async with live_capture_server(ScriptedEngine(tokenizer, ["hi"]), tokenizer) as server:
        session = await server.open_session("r", SamplingParams(max_tokens=3))
        api = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        with pytest.raises(BadRequestError, match="takes no images"):
            await api.chat.completions.create(model="m", messages=[user("What is this?", RED)])


def test_an_image_is_its_content_digest(vlm_renderer):
    """A resent image is the same image whatever object or data URL carries it (the decode cache aside)."""
    from molt.capture.render import _decode

    first = vlm_renderer.image(data_url(RED))
    _decode.cache_clear()
    again = vlm_renderer.image(data_url(RED).replace("image/png", "image/x-png"))
    assert first == again and first is not again and first.image.tobytes() == again.image.tobytes()
    assert first != vlm_renderer.image(data_url(BLUE))
