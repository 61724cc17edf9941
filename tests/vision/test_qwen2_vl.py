"""The tiny Qwen2-VL, a family whose positions depend on the images (M-RoPE: an image's tokens take a 2-D grid of
positions, so later tokens sit at their index plus a negative offset): the capture server renders it exactly as
its processor does, the embedded engine generates with the model's own 3-D positions (`get_rope_index`) and
per-row offsets while decoding, and the actor's log-probs of image-conditioned replies (two turns, two images,
two rollouts batched) agree with the engine's to 1e-5 in fp32 after the object store.

Its processor: transformers' `Qwen2VLProcessor` always loads a video processor, which needs torchvision, and no
torchvision builds against this machine's CPU torch 2.13. With torchvision, `ChatRenderer.from_pretrained` loads
it through `AutoProcessor`. Here the same class is built without the video half, from the checkpoint's own image
processor and tokenizer (each loaded with `from_pretrained`): `image_only`. Each test runs on Qwen2-VL and on
Qwen2.5-VL (windowed vision attention; its `get_rope_index` also takes video timing, hence keyword calls)."""

import asyncio
import io

import numpy as np
import pytest
import torch
import transformers as tf
from vision_helpers import offload, png, two_turn_rollouts, user

from molt.capture.render import ChatRenderer, canonical_messages, message_images
from molt.testing.models import build_tiny_qwen2_vl
from molt.trainer import Actor, logprobs
from molt.types import Experience, SamplingParams, Trajectory

FP32 = {"fsdp.device": "cpu", "actor.dtype": "float32"}


def image_only(processor_class):
    """`processor_class` without its video processor (module docstring)."""

    def init(self, image_processor=None, tokenizer=None, chat_template=None):
        processor_class.__init__(self, image_processor, tokenizer, None, chat_template=chat_template)

    return type(f"ImageOnly{processor_class.__name__}", (processor_class,), {"__init__": init})


@pytest.fixture(scope="module", params=["Qwen2-VL", "Qwen2.5-VL"])
def qwen_dir(request, tmp_path_factory):
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen"), qwen2_5=request.param == "Qwen2.5-VL")


@pytest.fixture(scope="module")
def qwen_renderer(qwen_dir):
    try:
        import torchvision  # noqa: F401
    except ImportError:  # what loading its processor then fails with
        with pytest.raises(ImportError, match="requires the Torchvision library"):
            tf.AutoProcessor.from_pretrained(qwen_dir)
    else:
        return ChatRenderer.from_pretrained(str(qwen_dir))
    tokenizer = tf.AutoTokenizer.from_pretrained(qwen_dir)
    family = (
        tf.Qwen2_5_VLProcessor
        if "2_5" in tf.AutoConfig.from_pretrained(qwen_dir).model_type
        else tf.Qwen2VLProcessor
    )
    processor = image_only(family)(
        tf.AutoImageProcessor.from_pretrained(qwen_dir), tokenizer, chat_template=tokenizer.chat_template
    )
    return ChatRenderer(tokenizer, processor)


@pytest.fixture(scope="module")
def qwen_engine(qwen_dir):
    from molt.engine.hf import HFEngine

    engine = HFEngine(str(qwen_dir))
    yield engine
    asyncio.run(engine.close())


def test_the_prompt_is_the_processors(qwen_renderer):
    processor = qwen_renderer.processor
    from PIL import Image

    red, blue = png("red"), png("blue", "square")
    messages = canonical_messages([user("What is this?", red, blue)], qwen_renderer.image)
    ids, images = qwen_renderer.encode_images(
        qwen_renderer.render(messages, None, True), message_images(messages)
    )
    theirs = processor.apply_chat_template(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": Image.open(io.BytesIO(b)).convert("RGB")} for b in (red, blue)
                ]
                + [{"type": "text", "text": "What is this?"}],
            }
        ],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )
    assert ids == theirs["input_ids"][0].tolist() and ids.count(processor.image_token_id) == 8  # 4 per image
    assert torch.equal(images["image_grid_thw"], torch.tensor([[1, 4, 4], [1, 4, 4]]))
    assert torch.equal(images["pixel_values"], theirs["pixel_values"]) and images["pixel_values"].shape == (
        32,
        1176,
    )
    assert set(images) == {"pixel_values", "image_grid_thw"}  # the per-token modalities are read off the ids


async def test_engine_and_trainer_logprobs_agree(
    qwen_engine, qwen_renderer, qwen_dir, ray_local, monkeypatch
):
    segments = await two_turn_rollouts(qwen_engine, qwen_renderer, ["red", "green"])
    image_id = qwen_renderer.processor.image_token_id
    banned = list(qwen_engine.spec.banned)
    assert len(banned) == 4  # <|image_pad|>, <|video_pad|>, <|vision_start|>, <|vision_end|>: never sampled
    for seg in segments:
        assert (seg.token_ids == image_id).sum() == 8 and seg.images["image_grid_thw"].shape == (2, 3)
        assert not set(banned) & set(seg.token_ids[seg.action_mask].tolist())
    exps = [
        offload(Experience.from_segment(Trajectory(f"r{i}", "g", [s]), 0)).reload()
        for i, s in enumerate(segments)
    ]
    actor = Actor.from_pretrained(str(qwen_dir), **FP32)

    def worst(batch):
        return max(
            np.abs(lps[exp.action_mask] - exp.behavior_logprobs).max()
            for exp, lps in zip(batch, actor.compute_logprobs(batch))
        )

    for batch in (exps, exps[:1], exps[1:]):  # one padded micro-batch of both rows, and each alone
        assert worst(batch) < 1e-5
    # the 3-D positions matter: plain 1-D positions give other log-probs
    monkeypatch.setattr(logprobs, "rope_positions", lambda lm, ids, mask, *_: (mask.cumsum(-1) - 1, None))
    assert worst(exps) > 1e-4


async def test_a_cached_text_prefix_and_images_in_one_prefill(qwen_engine, qwen_renderer):
    """A text row continuing its session's cached prefix (its positions start past the prefix) and an image row
    (M-RoPE positions) prefilled together: each gives what it gives alone."""
    greedy = SamplingParams(max_tokens=4, temperature=0)
    text = qwen_renderer.encode("<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n")
    first = await qwen_engine.generate(text, greedy, session_id="cached")
    more = (
        text
        + first.token_ids
        + qwen_renderer.encode("<|im_start|>user\nAgain?<|im_end|>\n<|im_start|>assistant\n")
    )
    messages = canonical_messages([user("What is this?", png("red"))], qwen_renderer.image)
    ids, images = qwen_renderer.encode_images(
        qwen_renderer.render(messages, None, True), message_images(messages)
    )
    alone = [await qwen_engine.generate(more, greedy), await qwen_engine.generate(ids, greedy, images=images)]
    reused = (await qwen_engine.prefix_stats())["reused_tokens"]
    await qwen_engine.pause()  # both wait for the same step, hence one prefill group
    tasks = [
        asyncio.create_task(qwen_engine.generate(more, greedy, session_id="cached")),
        asyncio.create_task(qwen_engine.generate(ids, greedy, images=images)),
    ]
    while qwen_engine.num_requests < 2:
        await asyncio.sleep(0)
    await qwen_engine.resume()
    together = await asyncio.gather(*tasks)
    assert (await qwen_engine.prefix_stats())["reused_tokens"] > reused  # the text row continued the cache
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids and b.logprobs == pytest.approx(a.logprobs, abs=1e-5)


def test_the_vllm_prompt_has_one_placeholder_per_image(qwen_renderer, qwen_dir):
    """vLLM expands each `<|image_pad|>` itself (tests/vision/test_vllm_inputs.py): images of different sizes
    take different runs (t*h*w / 4 tokens: 2 and 4), each goes back to the template's one placeholder."""
    from molt.engine import vllm as mv

    pad = qwen_renderer.processor.image_token_id
    merge = tf.AutoConfig.from_pretrained(qwen_dir).vision_config.spatial_merge_size
    messages = canonical_messages(
        [user("Compare", png("red", size=(112, 56)), png("blue", "square"))], qwen_renderer.image
    )
    rendered = qwen_renderer.render(messages, None, True)
    ids, images = qwen_renderer.encode_images(rendered, message_images(messages))
    sources = [i.image for i in message_images(messages)]
    assert images["image_grid_thw"].prod(-1).tolist() == [8, 16] and ids.count(pad) == 6
    prompt = mv.mm_prompt(ids, images, sources, pad, merge)
    assert (
        prompt["prompt_token_ids"] == qwen_renderer.encode(rendered)
        and prompt["multi_modal_data"]["image"] == sources
    )
    with pytest.raises(mv.RequestError, match="image tokens do not match"):
        mv.mm_prompt(ids, {**images, "image_grid_thw": images["image_grid_thw"].flip(0)}, sources, pad, merge)
