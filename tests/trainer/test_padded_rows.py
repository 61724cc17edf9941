"""Padded micro-batches reach the decoder without an attention mask (`molt.trainer.batching` docstring): at every
real position the log-probs, entropy, values, gradients and the MoE load-balancing loss equal those of each
sequence run alone, unpadded, through the plain Hugging Face model (full logits, fp32), for a dense decoder
(also with shared prefixes through the KV cache), an MoE, a sliding-window decoder, and two vision-language
models with images (LLaVA; Qwen2-VL, whose M-RoPE positions depend on the images)."""

import io
import random

import pytest
import torch
import transformers as tf
from test_shared_prefix import grouped_window
from trainer_helpers import make_window

from molt.modeling import ModelSpec
from molt.trainer.batching import collate
from molt.trainer.logprobs import CausalLMLogProbs
from molt.types import Experience

CPU = torch.device("cpu")


def _reference(lm, exps: list[Experience], banned=()) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per experience: (log-probs, entropy) [n] of each action token (0 elsewhere) from a forward of that sequence
    alone, after temperature, over the vocabulary without `banned`; backpropagates sum(lp * adv) + 0.1 * sum(ent)."""
    keep = torch.tensor([v for v in range(lm.config.get_text_config().vocab_size) if v not in set(banned)])
    out, loss = [], 0.0
    for e in exps:
        ids, images = torch.tensor([list(e.token_ids)]), dict(e.images or {})
        if images and hasattr(
            lm.model, "get_rope_index"
        ):  # Qwen2-VL: the tokens' modalities, as its processor
            images["mm_token_type_ids"] = (ids == lm.config.image_token_id).int()
        logits = lm(input_ids=ids, **images).logits[0, :-1].float()[:, keep] / e.temperature
        logp = torch.log_softmax(
            logits, -1
        )  # (context targets may be banned: their column is any, then masked)
        lp = logp.gather(-1, torch.searchsorted(keep, ids[0, 1:]).clamp(max=len(keep) - 1)[:, None])[:, 0]
        ent = -(logp.exp() * logp).sum(-1)
        mask = torch.tensor(list(e.action_mask[1:]), dtype=torch.bool)
        lp, ent = (torch.cat([torch.zeros(1), torch.where(mask, x, 0.0)]) for x in (lp, ent))
        loss = loss + (lp * torch.tensor(list(e.advantages), dtype=torch.float32)).sum() + 0.1 * ent.sum()
        out.append((lp.detach(), ent.detach()))
    loss.backward()
    return out


def _padded(lm, exps: list[Experience], share_prefix: bool = False) -> tuple[list, list]:
    """The trainer's log-probs and entropy per experience from one padded micro-batch (backpropagated as in
    `_reference`), and the attention masks the attention layers were given."""
    masks = []
    for m in lm.modules():
        if type(m).__name__.endswith("Attention") and "Vision" not in type(m).__name__:
            m.register_forward_pre_hook(
                lambda _, a, kw: masks.append(kw.get("attention_mask")), with_kwargs=True
            )
    mb = collate(exps, pad_id=0, device=CPU, share_prefix=share_prefix)
    assert (
        mb.input_ids.shape[0] == len(exps) and len({len(e.token_ids) for e in exps}) > 1
    )  # padding to check
    assert (mb.prefix is not None) == share_prefix
    if any(e.images for e in exps):
        assert mb.images
    lp, ent = CausalLMLogProbs(lm, chunk_size=5).train()(mb, True)
    (lp * mb.advantages).sum().add(0.1 * ent.sum()).backward()
    return [
        (lp[i, : len(e.token_ids)].detach(), ent[i, : len(e.token_ids)].detach()) for i, e in enumerate(exps)
    ], masks


def _compare(path, exps: list[Experience], share_prefix: bool = False) -> list:
    from molt.trainer import Actor

    spec = ModelSpec.from_pretrained(path)
    auto = tf.AutoModelForImageTextToText if spec.vision else tf.AutoModelForCausalLM
    ref_lm = auto.from_pretrained(path, dtype=torch.float32)  # plain transformers, its default "sdpa"
    lm = Actor.from_pretrained(str(path), **{"fsdp.device": "cpu"}).model.lm  # loaded as the trainer loads it
    assert lm.config._attn_implementation == ("sdpa" if spec.sliding else "molt_varlen")
    ref = _reference(ref_lm, exps, spec.banned)
    got, masks = _padded(lm, exps, share_prefix)
    assert sum(float(lp.abs().sum()) for lp, _ in ref) > 1.0
    for (lp0, ent0), (lp1, ent1) in zip(ref, got):
        assert (lp1 - lp0).abs().max() <= 1e-5 and (ent1 - ent0).abs().max() <= 1e-5
    grads = {n: p.grad for n, p in lm.named_parameters() if p.grad is not None}
    ref_grads = {n: p.grad for n, p in ref_lm.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys() and len(grads) > 5
    for name, g in grads.items():
        assert (g - ref_grads[name]).abs().max() <= 1e-5 * max(1.0, float(ref_grads[name].abs().max())), name
    return masks


@pytest.mark.parametrize("share_prefix", [False, True])
def test_a_dense_decoder_gets_no_mask_and_matches_each_row_alone(tiny_llama_dir, share_prefix):
    window = grouped_window(tiny_llama_dir, seed=5) if share_prefix else make_window(tiny_llama_dir, seed=5)
    masks = _compare(tiny_llama_dir, window, share_prefix)
    # transformers built no mask at all (`molt.trainer.packing`): SDPA's causal path (after a shared prefix, a
    # [q, k] causal mask built inside the attention)
    assert len(masks) == tf.AutoConfig.from_pretrained(tiny_llama_dir).num_hidden_layers * (1 + share_prefix)
    assert all(m is None for m in masks)


def test_an_moe_matches_each_row_alone(tiny_moe_dir):
    _compare(tiny_moe_dir, make_window(tiny_moe_dir, seed=6))


def test_a_sliding_window_decoder_matches_each_row_alone(tmp_path):
    from molt.testing.models import _decoder, build_tokenizer

    tokenizer = build_tokenizer()
    config = tf.MistralConfig(
        **_decoder(tokenizer), sliding_window=5
    )  # rows of 8-24 tokens: the window bites
    assert ModelSpec.from_config(config).sliding
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    window = make_window(tmp_path, seed=7)
    assert max(len(e.token_ids) for e in window) > 2 * 5
    _compare(tmp_path, window)


def test_llava_with_images_matches_each_row_alone(tiny_vlm_dir):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "vision"))
    from vision_helpers import image_window

    window = image_window(tiny_vlm_dir, "itit", seed=3)  # image rows and text rows, of different lengths
    _compare(tiny_vlm_dir, window)


def test_qwen2_vl_with_images_matches_each_row_alone(tmp_path):
    """M-RoPE: the trainer computes the rows' positions from the images (`rope_positions`, with the padding
    mask) and gives the decoder those and no mask; the reference lets the model derive them for a row alone."""
    from PIL import Image

    from molt.testing.models import build_tiny_qwen2_vl

    path = build_tiny_qwen2_vl(tmp_path)
    config, processor = tf.AutoConfig.from_pretrained(path), tf.AutoImageProcessor.from_pretrained(path)
    rng, window = random.Random(8), []
    for i, kind in enumerate("iti"):
        prompt, images = [rng.randrange(10, 300) for _ in range(rng.randint(3, 9))], None
        if kind == "i":
            buf = io.BytesIO()
            Image.new("RGB", (56, 56), rng.choice(["red", "blue"])).save(buf, format="PNG")
            images = dict(processor(images=[Image.open(buf)], return_tensors="pt"))
            n = int(images["image_grid_thw"].prod()) // 4  # 2 x 2 patches merged into one token
            prompt = (
                prompt
                + [config.vision_start_token_id]
                + [config.image_token_id] * n
                + [config.vision_end_token_id]
                + [rng.randrange(10, 300) for _ in range(2)]
            )
        reply = [rng.randrange(10, 300) for _ in range(rng.randint(3, 8))]
        mask = [0] * len(prompt) + [1] * len(reply)
        window.append(
            Experience(
                rollout_id=f"r{i}",
                group_id="g",
                segment_index=0,
                reward=0.0,
                num_tokens=len(mask),
                num_actions=len(reply),
                min_version=0,
                temperature=0.7,
                token_ids=prompt + reply,
                action_mask=mask,
                behavior_logprobs=[0.0] * len(mask),
                versions=[0] * len(mask),
                advantages=[rng.gauss(0.0, 1.0) * m for m in mask],
                images=images,
            )
        )
    _compare(path, window)


def test_critic_values_match_each_row_alone(tiny_llama_dir):
    from molt.trainer.critic import ValueModel

    window = make_window(tiny_llama_dir, seed=9)
    model = ValueModel(tf.AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32))
    torch.nn.init.normal_(model.value_head.weight)  # (it starts at zero)
    with torch.no_grad():
        values = model(collate(window, pad_id=0, device=CPU, need_advantages=False))
        for i, e in enumerate(window):
            hidden = model.backbone(input_ids=torch.tensor([list(e.token_ids)])).last_hidden_state[0]
            v = model.value_head(hidden).squeeze(-1)  # the value of token t's state: position t - 1
            expected = torch.cat([torch.zeros(1), v[:-1]]) * torch.tensor(list(e.action_mask))
            assert expected.abs().sum() > 0
            assert (values[i, : len(e.token_ids)] - expected).abs().max() <= 1e-5


def test_moe_load_balancing_loss_counts_real_tokens_only(tiny_moe_dir):
    """The Switch loss of a padded window equals the hand formula over the rows' real tokens (router logits of
    each row alone): padded tokens route too, but weigh nothing."""
    from molt.trainer import Actor

    window = make_window(tiny_moe_dir, n=4, seed=10)
    actor = Actor.from_pretrained(
        str(tiny_moe_dir),
        **{
            "fsdp.device": "cpu",
            "actor.aux_loss_coef": 0.01,
            "train.max_tokens_per_gpu": 0,
            "train.micro_batch_size": 0,
        },
    )
    m = actor.train_step(window)
    lm = tf.AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32)
    with torch.no_grad():
        per_row = [
            lm(torch.tensor([list(e.token_ids)]), output_router_logits=True).router_logits for e in window
        ]
    expected, e_, k = [], lm.config.num_experts, lm.config.num_experts_per_tok
    for layer in zip(*per_row):
        p = torch.softmax(torch.cat(layer).float(), -1)
        f = torch.nn.functional.one_hot(p.topk(k).indices, e_).sum(1).float().mean(0)
        expected.append(e_ * (f * p.mean(0)).sum().item())
    assert m["moe/aux_loss"] == pytest.approx(sum(expected) / len(expected), rel=1e-5)
