"""Tiny real Hugging Face checkpoints built locally, for tests and for users writing tests.

Each builder writes a complete checkpoint directory (config, safetensors weights, generation config and a
fast tokenizer with a chat template) that loads back through `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained`: the same loading path as a real model. No network, well under a second.

- The tokenizer is a byte-level BPE trained with `tokenizers` on a small built-in corpus (so any text,
  JSON included, round-trips), with ChatML special tokens `<|im_start|>`, `<|im_end|>` (EOS, as in SmolLM2
  and Qwen) and `<|endoftext|>` (padding), and single-token (non-special) markers `<tool_call>`,
  `</tool_call>`, `<think>`, `</think>` as in Qwen's vocabularies.
- `CHATML_TOOLS_TEMPLATE` renders `tools` in a system block, assistant `tool_calls` as
  `<tool_call>{json}</tool_call>` blocks and `tool` turns; `QWEN3_THINK_TEMPLATE` is the same but drops
  `<think>...</think>` from assistant turns before the last user turn (so history is rewritten between
  turns, which the capture server must detect as a `template_rewrite`).
- Models: a dense Llama-style model (tied embeddings like SmolLM2), a small Qwen2-MoE model (for routing
  replay later) and a LLaVA vision-language model (`build_tiny_vlm`: a 1-layer CLIP vision tower on 28x28
  pixels, 14-pixel patches, so each image is 4 `<image>` tokens; loads with `AutoModelForImageTextToText` and
  `AutoProcessor`, whose PIL image processor needs no torchvision) and a Qwen2-VL (`build_tiny_qwen2_vl`:
  positions that depend on the images, M-RoPE; 56x56 pixels, so each image is 4 `<|image_pad|>` tokens).
  `Qwen2VLProcessor` loads a video processor, which needs torchvision: without it, build the processor from
  the saved image processor and tokenizer (tests/vision/test_qwen2_vl.py). Weights are random but seeded.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKER_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]

# one ChatML template with tools, a data file (as Hugging Face ships chat_template.jinja); DROP_THINK: whether
# reasoning before the last user turn is dropped (QWEN3_THINK_TEMPLATE)
_TEMPLATE = (Path(__file__).parent / "chatml_tools.jinja").read_text().strip()
CHATML_TOOLS_TEMPLATE = _TEMPLATE.replace("DROP_THINK", "false")
# content may be a list of parts: text parts as their text, image parts as the processor's placeholder
VLM_TEMPLATE = (
    "{%- macro show(c) -%}{%- if c is string -%}{{ c }}{%- else -%}{%- for p in c -%}{%- if p.type == "
    "'image' -%}<image>{%- else -%}{{ p.text }}{%- endif -%}{%- endfor -%}{%- endif -%}{%- endmacro -%}"
    + CHATML_TOOLS_TEMPLATE.replace("{{ m.content }}", "{{ show(m.content) }}")
)
QWEN3_THINK_TEMPLATE = _TEMPLATE.replace("DROP_THINK", "true")

_CORPUS = json.loads(
    (Path(__file__).parent / "tokenizer_corpus.json").read_text()
)  # what the BPE learns from


def build_tokenizer(vocab_size: int = 384, template: str = CHATML_TOOLS_TEMPLATE):
    """A byte-level BPE `PreTrainedTokenizerFast` with ChatML specials and the given chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        chat_template=template,
        model_max_length=512,
    )


def _save(model, tokenizer, path: Path) -> Path:
    from transformers import GenerationConfig

    path.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "molt_tiny.json").write_text(json.dumps({"builder": "molt.testing"}))
    return path


def _decoder(tokenizer, hidden_size: int = 64, **more) -> dict:
    """Keyword arguments of a tiny decoder's config over `tokenizer` (2 layers, 4 heads, 2 of them key/value)."""
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        **more,
    }


def build_tiny_llama(
    path: str | Path,
    *,
    seed: int = 0,
    template: str = CHATML_TOOLS_TEMPLATE,
    hidden_size: int = 64,
    num_layers: int = 2,
    max_positions: int = 512,
) -> Path:
    """Save a tiny dense Llama-style causal LM (tied embeddings, GQA) with its tokenizer to `path`."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = build_tokenizer(template=template)
    config = LlamaConfig(
        **_decoder(
            tokenizer,
            hidden_size,
            num_hidden_layers=num_layers,
            max_position_embeddings=max_positions,
            rms_norm_eps=1e-5,
        )
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return _save(model, tokenizer, Path(path))


def build_tiny_moe(
    path: str | Path, *, seed: int = 0, template: str = CHATML_TOOLS_TEMPLATE, hidden_size: int = 64
) -> Path:
    """Save a tiny Qwen2-MoE causal LM (4 experts, top-2 routing) with its tokenizer to `path`; 4 heads of
    hidden_size / 4 (vLLM's CPU attention needs 64: hidden_size=256)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    tokenizer = build_tokenizer(template=template)
    config = Qwen2MoeConfig(
        **_decoder(
            tokenizer,
            hidden_size,
            moe_intermediate_size=hidden_size // 2,
            shared_expert_intermediate_size=hidden_size,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            tie_word_embeddings=False,
        )
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return _save(model, tokenizer, Path(path))


def _vlm_tokenizer(placeholder: str, *specials: str):
    """The ChatML tokenizer whose template shows an image part as `placeholder`, with `specials` added, and the
    keyword arguments of a tiny decoder over it."""
    from tokenizers import AddedToken

    tokenizer = build_tokenizer(template=VLM_TEMPLATE.replace("<image>", placeholder))
    tokenizer.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in specials], special_tokens=True
    )
    return tokenizer, _decoder(tokenizer)


def build_tiny_vlm(path: str | Path, *, seed: int = 0) -> Path:
    """Save a tiny LLaVA (CLIP vision tower + Llama decoder) with its processor and tokenizer to `path`."""
    import torch
    import transformers as tf
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    tokenizer, decoder = _vlm_tokenizer("<image>", "<image>")
    text = tf.LlamaConfig(**decoder)
    vision = tf.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = tf.LlavaConfig(
        vision_config=vision,
        text_config=text,
        vision_feature_layer=-1,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = tf.AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    pixels = LlavaImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    tf.LlavaProcessor(
        pixels,
        tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=VLM_TEMPLATE,
    ).save_pretrained(path)
    return _save(model, tokenizer, Path(path))


def build_tiny_qwen2_vl(path: str | Path, *, seed: int = 0, qwen2_5: bool = False) -> Path:
    """Save a tiny Qwen2-VL (a 1-block vision transformer with the 2x2 patch merger, an M-RoPE Qwen2 decoder;
    `qwen2_5`: Qwen2.5-VL's, 2 blocks, windowed then full attention) with its tokenizer, chat template and image
    processor to `path` (module docstring: its processor)."""
    import torch
    import transformers as tf
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    marks = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer, decoder = _vlm_tokenizer("<|vision_start|><|image_pad|><|vision_end|>", *marks)
    start, end, image, video = tokenizer.convert_tokens_to_ids(marks)
    decoder["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    vision = (
        {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "fullatt_block_indexes": [1],
            "window_size": 56,
        }
        if qwen2_5
        else {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2}
    )
    config = (tf.Qwen2_5_VLConfig if qwen2_5 else tf.Qwen2VLConfig)(
        text_config=decoder,
        vision_config=vision,
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = tf.AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56).save_pretrained(path)
    return _save(model, tokenizer, Path(path))
