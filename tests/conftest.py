"""Shared fixtures: tiny real checkpoints built once per test session (no network), their tokenizer, one real
embedded engine, and a local Ray instance."""

import asyncio
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from molt.testing.models import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_think_dir(tmp_path_factory):
    from molt.testing.models import QWEN3_THINK_TEMPLATE, build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-think"), template=QWEN3_THINK_TEMPLATE)


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory):
    from molt.testing.models import build_tiny_moe

    return build_tiny_moe(tmp_path_factory.mktemp("tiny-moe"))


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory):
    from molt.testing.models import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))


@pytest.fixture
def ray_local():
    """A local Ray instance shared by the tests that need one (starting one takes seconds; Ray shuts it down
    at exit). A test that needs its own cluster shuts this one down and the next user starts it again."""
    import ray

    if not ray.is_initialized():
        ray.init(
            "local",
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
            runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}},
        )
    return ray


@pytest.fixture(scope="session")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="session")
def hf_engine(tiny_llama_dir):
    """One real embedded engine for the whole session (its worker thread serves any event loop)."""
    from molt.engine.hf import HFEngine

    engine = HFEngine(str(tiny_llama_dir))
    yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="session")
def quickstart_argv():
    """The reference's quick-start flag set (tests/data) as argv, its $VARS (a user's paths and sizes) filled
    from keyword arguments; `${VAR:-default}` falls back to its default."""
    import re
    import shlex
    from pathlib import Path

    lines = (Path(__file__).parent / "data" / "reference-quickstart-flags.txt").read_text().splitlines()
    text = " ".join(line for line in lines if not line.startswith("#")).replace("$$", "1")

    def fill(**values: str) -> list[str]:
        def var(m: re.Match) -> str:  # ${NAME:-default} or $NAME (which must be given)
            name, default = m.group(1) or m.group(3), m.group(2)
            return str(values[name]) if default is None or name in values else default

        return shlex.split(re.sub(r"\$\{(\w+):-([^}]*)\}|\$(\w+)", var, text))

    return fill
