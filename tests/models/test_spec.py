"""The one model description (`molt.modeling.ModelSpec`): read once from a checkpoint's config files, and what the
embedded engine, the capture renderer and the trainer act on, instead of each probing the config its own way."""

import asyncio
import json

from transformers import AutoTokenizer, LlamaConfig

from molt.modeling import ModelSpec


def test_a_text_checkpoint(tiny_llama_dir):
    spec = ModelSpec.from_pretrained(tiny_llama_dir)
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert spec.eos_token_ids == (tok.convert_tokens_to_ids("<|im_end|>"),)
    assert spec.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert not spec.vision and spec.banned == () and spec.image_token_id is None and spec.merge_size == 1
    assert (spec.max_model_len, spec.vocab_size) == (512, len(tok))
    assert not spec.dynamic_rope and not spec.sliding and spec.cache_kw in ("cache", "past_key_values")


def test_without_a_generation_config_the_model_config_answers(tiny_llama_dir, tmp_path):
    """No generation_config.json: EOS from the config, the pad id falls back to the first EOS."""
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps({**config, "eos_token_id": [5, 7], "pad_token_id": None})
    )
    spec = ModelSpec.from_pretrained(tmp_path)
    assert spec.eos_token_ids == (5, 7) and spec.pad_token_id == 5


def test_rope_kind_and_sliding_window_from_the_config():
    small = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 64}
    dynamic = LlamaConfig(**small, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    assert (
        ModelSpec.from_config(dynamic).dynamic_rope
        and not ModelSpec.from_config(LlamaConfig(**small)).dynamic_rope
    )
    from transformers import AutoConfig

    assert ModelSpec.from_config(
        AutoConfig.for_model("gemma3_text", **small, layer_types=["sliding_attention", "full_attention"])
    ).sliding
    assert not ModelSpec.from_config(AutoConfig.for_model("qwen2", **small)).sliding


def test_a_vision_checkpoint_and_its_users_share_one_description(tiny_vlm_dir):
    from molt.capture.render import ChatRenderer
    from molt.engine.hf import HFEngine
    from molt.trainer.logprobs import CausalLMLogProbs

    spec = ModelSpec.from_pretrained(tiny_vlm_dir)
    image = AutoTokenizer.from_pretrained(tiny_vlm_dir).convert_tokens_to_ids("<image>")
    assert spec.vision and spec.banned == (image,) and spec.image_token_id == image
    engine = HFEngine(str(tiny_vlm_dir))
    try:
        assert engine.spec == spec and engine.eos_token_ids == list(spec.eos_token_ids)
        assert CausalLMLogProbs(engine.model).banned == list(spec.banned)
    finally:
        asyncio.run(engine.close())
    assert ChatRenderer.from_pretrained(str(tiny_vlm_dir)).processor is not None
