"""Fixtures for capture tests (the tiny model's tokenizer and engine come from tests/conftest.py)."""

import pytest


@pytest.fixture(scope="session")
def think_tokenizer(tiny_think_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_think_dir)
