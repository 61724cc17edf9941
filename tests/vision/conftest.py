"""Fixtures of the vision tests: one embedded engine and one renderer (with its processor) on the tiny LLaVA."""

import asyncio

import pytest


@pytest.fixture(scope="session")
def vlm_engine(tiny_vlm_dir):
    from molt.engine.hf import HFEngine

    engine = HFEngine(str(tiny_vlm_dir))
    yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="session")
def vlm_renderer(tiny_vlm_dir):
    from molt.capture.render import ChatRenderer

    return ChatRenderer.from_pretrained(str(tiny_vlm_dir))
