"""Chat rendering: the model's own chat template and tokenizer, behind one small class.

Messages reaching the template are *canonical* (both wires convert to this form, so one conversation renders
the same whichever SDK sent it): {"role": system|user|assistant|tool, "content": str} plus, on assistant turns,
"tool_calls": [{"id", "type": "function", "function": {"name", "arguments": dict}}] and, on tool turns,
"tool_call_id". Arguments are dicts because Hugging Face templates `tojson` them. Canonical messages are also
what the segment tracker compares, so equal conversations compare equal.

Template errors (e.g. a template that raises on roles that do not alternate) are the client's mistake: they
surface as `RenderError` (a ValueError), which the server answers with 400.
"""
from __future__ import annotations

from typing import Any

from jinja2 import TemplateError


class RenderError(ValueError):
    """The chat template rejected the conversation."""


class ChatRenderer:
    """Renders canonical messages with a Hugging Face tokenizer's chat template and (de)tokenizes text."""

    def __init__(self, tokenizer: Any):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; capture needs one to render conversations")
        self.tokenizer = tokenizer
        self._token_text: dict[int, str] = {}
        # The Rust tokenizer directly when decoding needs no Python post-processing: the per-call overhead of
        # the transformers wrapper is larger than the tokenization itself at chat-turn sizes.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if not getattr(tokenizer, "clean_up_tokenization_spaces", True) else None

    @classmethod
    def from_pretrained(cls, path: str) -> ChatRenderer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path))

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt)
        except (TemplateError, TypeError, ValueError, KeyError) as e:  # incl. a template's raise_exception(...)
            raise RenderError(f"the model's chat template rejected the conversation: {e}") from None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token markup in it becomes the special tokens (as templates intend)."""
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        if self._backend is not None:
            return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token, for logprob entries (cached: the vocabulary is fixed)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text


def canonical_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-format chat messages (plain dicts) -> canonical messages. Idempotent."""
    from molt.capture.tools import tool_call

    out = []
    for m in messages:
        role = "system" if m["role"] == "developer" else m["role"]
        content = m.get("content")
        if isinstance(content, list):  # text content parts
            content = "".join(part.get("text") or "" for part in content)
        msg: dict[str, Any] = {"role": role, "content": content or ""}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = [tool_call(c.get("id") or "", c["function"]["name"], c["function"].get("arguments") or {})
                                 for c in m["tool_calls"]]
        if role == "tool":
            msg["tool_call_id"] = m.get("tool_call_id") or ""
            if m.get("name"):
                msg["name"] = m["name"]
        out.append(msg)
    return out


def canonical_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """OpenAI-format tool definitions; an empty list means no tools (OpenAI itself rejects `tools=[]`)."""
    if not tools:
        return None
    return [{"type": "function", "function": {k: v for k, v in t["function"].items() if v is not None}} for t in tools]
