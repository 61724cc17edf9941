"""The embedded engine and the actor on image-conditioned replies of the tiny LLaVA: the prefix cache never
carries keys/values across images, the engine's behavior log-probs and the trainer's recomputed ones agree to
1e-5 in fp32 (after the experiences went through the object store), the engine never samples the image token
(the trainer masks it the same way), and `freeze_visual_encoder` freezes exactly the vision tower."""

import numpy as np
import pytest
import torch
from vision_helpers import offload, png, two_turn_rollouts, user

from molt.capture.render import canonical_messages, message_images
from molt.trainer import Actor
from molt.types import Experience, SamplingParams, Trajectory

FP32 = {"fsdp.device": "cpu", "actor.dtype": "float32"}


def prompt(renderer, *images):
    messages = canonical_messages([user("What is this?", *images)], renderer.image)
    return renderer.encode_images(renderer.render(messages, None, True), message_images(messages))


async def test_prefix_cache_is_not_reused_across_images(vlm_engine, vlm_renderer):
    (ids, red), (same_ids, blue) = (
        prompt(vlm_renderer, png("red")),
        prompt(vlm_renderer, png("blue", "square")),
    )
    assert ids == same_ids  # the placeholder tokens are the same: only the pixels differ
    greedy = SamplingParams(max_tokens=4, temperature=0)
    before = vlm_engine.prefixes.stats()["reused_tokens"]
    a = await vlm_engine.generate(ids, greedy, session_id="s", images=red)
    b = await vlm_engine.generate(ids, greedy, session_id="s", images=blue)
    fresh = await vlm_engine.generate(ids, greedy, images=blue)
    assert b.token_ids == fresh.token_ids and b.logprobs == pytest.approx(fresh.logprobs, abs=1e-5)
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) > 1e-3  # the image matters
    assert vlm_engine.prefixes.stats()["reused_tokens"] == before


async def test_the_engine_never_samples_vision_tokens(vlm_engine, vlm_renderer, tiny_vlm_dir):
    """The engine samples from, and records log-probs of, the distribution without the image token: its
    log-probs are those of that masked distribution, recomputed here by one plain forward of the whole sequence
    with the pixels (the sampler draws from the same tensor, where the image token has probability 0). At
    temperature 100 the tiny model is close to uniform: unmasked, the image token would hold ~1/390 of the mass."""
    from transformers import AutoModelForImageTextToText

    banned = list(vlm_engine.spec.banned)
    assert banned == [vlm_renderer.processor.image_token_id]
    ids, red = prompt(vlm_renderer, png("red"))
    out = await vlm_engine.generate(
        ids, SamplingParams(max_tokens=40, min_tokens=40, temperature=100.0, seed=0), images=red
    )
    assert banned[0] not in out.token_ids and len(out.token_ids) == 40
    model = AutoModelForImageTextToText.from_pretrained(str(tiny_vlm_dir))
    with torch.no_grad():
        logits = (
            model(input_ids=torch.tensor([ids + out.token_ids]), **red).logits[0, len(ids) - 1 : -1] / 100
        )
    picked = torch.tensor(out.token_ids)[:, None]
    plain = logits.log_softmax(-1).gather(1, picked)[:, 0]
    logits[:, banned] = -float("inf")
    masked = logits.log_softmax(-1).gather(1, picked)[:, 0]
    assert (masked - torch.tensor(out.logprobs)).abs().max() < 1e-5
    assert (masked - plain).min() > 1e-3  # renormalized without the image token's mass


async def test_engine_and_trainer_logprobs_agree_on_image_replies(
    vlm_engine, vlm_renderer, tiny_vlm_dir, ray_local
):
    segments = await two_turn_rollouts(vlm_engine, vlm_renderer, ["red", "green"])
    exps = [
        offload(Experience.from_segment(Trajectory(f"r{i}", "g", [s]), 0)) for i, s in enumerate(segments)
    ]
    assert all(e.images is None for e in exps)  # the pixels travel with the payload
    exps = [e.reload() for e in exps]
    assert [e.images["pixel_values"].shape[0] for e in exps] == [2, 2]
    actor = Actor.from_pretrained(str(tiny_vlm_dir), **FP32)
    for batch in (exps, exps[:1], exps[1:]):  # one padded micro-batch of both rows, and each alone
        for exp, lps in zip(batch, actor.compute_logprobs(batch)):
            assert exp.num_actions > 0
            assert np.abs(lps[exp.action_mask] - exp.behavior_logprobs).max() < 1e-5
    blind = Experience.from_segment(Trajectory("r0", "g", [segments[0]]), 0)
    blind.images = None  # the same tokens without the pixels: the image tokens' plain embeddings
    lps = actor.compute_logprobs([blind])[0]
    assert np.abs(lps[blind.action_mask] - blind.behavior_logprobs).max() > 1e-3
    packed = Actor.from_pretrained(str(tiny_vlm_dir), **{"fsdp.packing_samples": True}, **FP32)
    with pytest.raises(ValueError, match="packing_samples"):
        packed.compute_logprobs(exps)


async def test_freeze_visual_encoder(vlm_engine, vlm_renderer, tiny_vlm_dir, tiny_llama_dir):
    (segment,) = await two_turn_rollouts(vlm_engine, vlm_renderer, ["blue"])
    exp = Experience.from_segment(Trajectory("r", "g", [segment]), 0)
    exp.advantages = [1.0 if m else 0.0 for m in exp.action_mask]
    actor = Actor.from_pretrained(
        str(tiny_vlm_dir), **{"actor.freeze_visual_encoder": True, "actor.adam.lr": 1e-2}, **FP32
    )
    before = {n: p.detach().clone() for n, p in actor.lm.named_parameters()}
    actor.train_step([exp])
    changed = {n for n, p in actor.lm.named_parameters() if not torch.equal(p, before[n])}
    assert changed and not any(".vision_tower." in n for n in changed)
    assert any(".multi_modal_projector." in n for n in changed) and any(
        ".language_model." in n for n in changed
    )
    with pytest.raises(ValueError, match="freeze_visual_encoder: .* has no vision encoder"):
        Actor.from_pretrained(str(tiny_llama_dir), **{"actor.freeze_visual_encoder": True}, **FP32)
