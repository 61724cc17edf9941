"""What the vLLM engine sends for a request with images, built by its pure helpers on CPU (vLLM itself needs a GPU:
the `VLLMEngine` path with images is not run here). vLLM expands each image's placeholder itself, so the prompt
must go back to the one placeholder per image the chat template wrote: the reference is the tokenizer's own
encoding of the rendered text, before any processor expanded it. And the vision tokens are banned by a -inf
logit bias, which vLLM adds before temperature and the processed log-probs."""

import pytest
from vision_helpers import png, user

from molt.capture.render import canonical_messages, message_images
from molt.engine import vllm as mv
from molt.engine.base import RequestError
from molt.modeling import ModelSpec
from molt.types import SamplingParams


def collapse_case(renderer, *images, text="What is this?"):
    """(expanded ids, processor inputs, decoded sources, the unexpanded ids) of a one-turn image prompt."""
    messages = canonical_messages([user(text, *images)], renderer.image)
    rendered = renderer.render(messages, None, True)
    ids, inputs = renderer.encode_images(rendered, message_images(messages))
    return ids, inputs, [i.image for i in message_images(messages)], renderer.encode(rendered)


def test_llava_prompt_goes_back_to_one_placeholder_per_image(vlm_renderer):
    image = vlm_renderer.processor.image_token_id
    for images in (
        [png("red")],
        [png("red"), png("blue", "square")],
    ):  # two images: one run of 8 placeholders
        ids, inputs, sources, raw = collapse_case(vlm_renderer, *images)
        assert ids.count(image) == 4 * len(images) and raw.count(image) == len(images)
        prompt = mv.mm_prompt(ids, inputs, sources, image)
        assert prompt["prompt_token_ids"] == raw
        assert prompt["multi_modal_data"] == {"image": sources} and sources[0].size == (32, 32)
    assert mv.mm_prompt(ids, None, None, image) == {"prompt_token_ids": ids}  # a text request
    for bad in (sources[:1], sources * 2, []):  # the images do not match the placeholders
        with pytest.raises(RequestError, match="image tokens do not match"):
            mv.mm_prompt(ids, inputs, bad, image)
    with pytest.raises(RequestError, match="image tokens do not match"):
        mv.mm_prompt(
            ids[: -len(ids) + ids.index(image) + 2] + ids[ids.index(image) + 3 :], inputs, sources, image
        )


def test_vision_tokens_are_banned_by_a_minus_infinite_bias(tiny_vlm_dir):
    banned = list(ModelSpec.from_pretrained(tiny_vlm_dir).banned)
    kw = mv.sampling_kwargs(SamplingParams(max_tokens=4, temperature=100.0), 4, [2], banned=banned)
    assert kw["logit_bias"] == {banned[0]: float("-inf")}
    assert "logit_bias" not in mv.sampling_kwargs(SamplingParams(max_tokens=4), 4, [2])  # a text model
