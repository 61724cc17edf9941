"""Inference engines behind one protocol (`base.Engine`): the embedded transformers engine (`hf.HFEngine`), the
session-sticky `router.Router`. Importing this package stays light: torch loads only when `HFEngine` is used."""

from molt.engine.base import Engine, EngineError, EngineGone, RequestError
from molt.engine.router import Router

__all__ = ["Engine", "EngineError", "EngineGone", "HFEngine", "RequestError", "Router"]


def __getattr__(name: str):
    if name == "HFEngine":  # lazy: pulls in torch and transformers
        from molt.engine.hf import HFEngine

        return HFEngine
    raise AttributeError(f"module 'molt.engine' has no attribute {name!r}")
