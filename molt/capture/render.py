"""Chat rendering: the model's own chat template and tokenizer, behind one small class.

Design notes and decisions: docs/internals.md, section `molt/capture/render.py`.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import hashlib
import io
from collections.abc import Callable, Collection
from typing import Any

from jinja2 import TemplateError

from molt.capture.tools import tool_call
from molt.modeling import ModelSpec


class RenderError(ValueError):
    """The chat template rejected the conversation."""


class ImageRef(str):
    """An image part's identity (the sha256 of its bytes) carrying the decoded RGB image in `image`."""

    image: Any


@functools.lru_cache(maxsize=32)
def _decode(data: bytes, max_pixels: int) -> ImageRef:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.width * im.height > max_pixels:
                raise ValueError(
                    f"image_url: a {im.width}x{im.height} image is over the limit of {max_pixels} pixels "
                    "(max_image_pixels)"
                )
            rgb = im.convert("RGB")  # decodes it all: truncated data fails here
    except (OSError, SyntaxError, Image.DecompressionBombError) as e:
        raise ValueError(f"image_url: the image cannot be decoded ({e})") from None
    ref = ImageRef(hashlib.sha256(data).hexdigest())
    ref.image = rgb
    return ref


class ChatRenderer:
    """Renders canonical messages with a Hugging Face tokenizer's chat template and (de)tokenizes text; with a
    `processor` (vision-language models) also images (module docstring)."""

    def __init__(
        self,
        tokenizer: Any,
        processor: Any = None,
        *,
        max_image_pixels: int = 1 << 24,
        allow_remote_images: bool = False,
    ):
        self.template = getattr(processor, "chat_template", None) or getattr(tokenizer, "chat_template", None)
        if not self.template:
            raise ValueError("the tokenizer has no chat template; capture needs one to render conversations")
        self.tokenizer, self.processor = tokenizer, processor
        self.max_image_pixels, self.allow_remote_images = max_image_pixels, allow_remote_images
        self.reasoning = "reasoning_content" in self.template  # the template renders an assistant's reasoning
        self._token_text: dict[int, str] = {}
        # special tokens reply text leaves out when some are kept (keep_special)
        self._hidden: set[int] | None = None
        # The Rust tokenizer directly when decoding needs no Python post-processing: the per-call overhead of
        # the transformers wrapper is larger than the tokenization itself at chat-turn sizes.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if not getattr(tokenizer, "clean_up_tokenization_spaces", True) else None

    @classmethod
    def from_pretrained(cls, path: str, **options: Any) -> ChatRenderer:
        from transformers import AutoTokenizer

        if ModelSpec.from_pretrained(path).vision:
            from transformers import AutoProcessor  # imports torch and the modeling code: vision models only

            processor = AutoProcessor.from_pretrained(path)
            return cls(processor.tokenizer, processor, **options)
        return cls(AutoTokenizer.from_pretrained(path), **options)

    def image(self, url: str) -> ImageRef:
        """The image of an `image_url` (module docstring); ValueError naming the problem."""
        if self.processor is None:
            raise ValueError("this model takes no images (it has no image processor)")
        if url.startswith(("http://", "https://")):
            if not self.allow_remote_images:
                raise ValueError(
                    "image_url: remote URLs are refused (allow_remote_images is off); send the image "
                    "inline as a data URL, data:image/png;base64,..."
                )
            import urllib.request

            with urllib.request.urlopen(url, timeout=30) as response:
                return _decode(response.read(), self.max_image_pixels)
        head, _, data = url.partition(",")
        if not (head.startswith("data:") and head.endswith(";base64")):
            raise ValueError("image_url must be a base64 data URL (data:image/png;base64,...)")
        try:
            return _decode(base64.b64decode(data, validate=True), self.max_image_pixels)
        except binascii.Error as e:
            raise ValueError(f"image_url: the base64 data is malformed ({e})") from None

    def encode_images(self, text: str, images: list[ImageRef]) -> tuple[list[int], dict[str, Any] | None]:
        """(token ids, processor inputs) of a rendered chunk whose placeholders stand for `images`, in order: the
        processor expands each placeholder into the image's tokens; its inputs have one entry per image along
        dim 0, so a segment's chunks concatenate (LLaVA, Qwen2-VL; not Idefics3's per-text batches)."""
        if not images:
            return self.encode(text), None
        try:
            out = self.processor(
                text=[text], images=[i.image for i in images], add_special_tokens=False, return_tensors="pt"
            )
        except (ValueError, IndexError) as e:
            raise RenderError(f"the images do not match the conversation's image placeholders: {e}") from None
        for per_token in ("attention_mask", "mm_token_type_ids"):  # Qwen2-VL's modalities: read off the ids
            out.pop(per_token, None)
        return out.pop("input_ids")[0].tolist(), dict(out)

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
    ) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                chat_template=self.template,
                add_generation_prompt=add_generation_prompt,
            )
        except (
            TemplateError,
            TypeError,
            ValueError,
            KeyError,
        ) as e:  # incl. a template's raise_exception(...)
            raise RenderError(f"the model's chat template rejected the conversation: {e}") from None

    def extension(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        known: int,
        prompt: str = "",
        window: bool | None = None,
    ) -> tuple[str, str, str] | None:
        """How the template goes on from `messages[:known]` (ending with a reply) to `messages`: (the reply's text
        after the generation prompt before it, the text that follows it up to the new generation prompt included,
        the whole conversation's text or "" where only a window of it was rendered); None where the later
        messages change how the earlier ones render (a rewrite). `prompt`: the text of `messages[:known - 1]`
        with its generation prompt, where the caller kept it. `window`: render a window of the conversation
        (True), all of it (False), or a window where the template is prefix-stable (None): then a turn's
        rendering does not grow with the history (docs/internals.md)."""
        if window is None and self.prefix_stable and known > 4:
            # refused for the window (roles a template checks), not for the conversation: render all of it
            with contextlib.suppress(RenderError):
                return self.extension(messages, tools, known, "", True)
        if window:  # the first message, the reply, the one or two before it (an even number left out between,
            cut = known - 2 - (known - 3) % 2  # so that roles keep their index parity) and all after it
            messages, known = messages[:1] + messages[cut:], known - cut + 1
        prompt = prompt or self.render(messages[: known - 1], tools, True)
        before = self.render(messages[:known], tools, False)
        after = self.render(messages, tools, True)
        same = after.startswith(before) and before.startswith(prompt)
        return (before[len(prompt) :], after[len(before) :], "" if window else after) if same else None

    @functools.cached_property
    def prefix_stable(self) -> bool:
        """Whether the template renders the end of a conversation the same from a window of it (`extension`):
        checked once, on probe conversations (system prompt or not, tools or not, replies with reasoning and
        tool calls, one and several tool results) at every reply, with one, two and all the later messages."""
        for messages in (_PROBE, [{"role": "system", "content": "s"}, *_PROBE]):
            for tools, known in ((t, k) for t in (None, _PROBE_TOOLS) for k in range(5, len(messages))):
                for end in (
                    {known + 1, known + 2, len(messages)}
                    if messages[known - 1]["role"] == "assistant"
                    else ()
                ):
                    try:
                        both = [
                            self.extension(messages[:end], tools, known, "", w) or () for w in (False, True)
                        ]
                    except RenderError:
                        continue  # a conversation this template refuses
                    if both[0][:2] != both[1][:2]:
                        return False
        return True

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token markup in it becomes the special tokens (as templates intend)."""
        if (
            self._backend is not None
        ):  # encode_batch lets other threads run meanwhile (`encode` holds the GIL)
            return self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        if self._backend is not None:
            return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def keep_special(self, texts: tuple[str, ...]) -> None:
        """Keep these tokens (tool-call markers) in `reply_text` even where the tokenizer marks them special."""
        special = {i: t.content for i, t in self.tokenizer.added_tokens_decoder.items() if t.special}
        hidden = {i for i, text in special.items() if text not in texts}
        self._hidden = hidden if len(hidden) < len(special) else None

    def reply_text(self, token_ids: list[int]) -> str:
        """The text of sampled tokens as clients see it and tool parsers read it: special tokens left out,
        except those `keep_special` names."""
        if self._hidden is None:
            return self.decode(token_ids, skip_special_tokens=True)
        return self.decode([i for i in token_ids if i not in self._hidden])

    def token_text(self, token_id: int) -> str:
        """The text of one token, for logprob entries (cached: the vocabulary is fixed)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text


_PROBE_TOOLS = [
    {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
]


# the conversation `ChatRenderer.prefix_stable` renders both ways (also after a system prompt); its replies carry
# reasoning_content, which templates without a channel for it ignore
_PROBE = [
    {
        "role": role,
        "content": text,
        **(
            {"tool_call_id": "c1"}
            if role == "tool"
            else {"reasoning_content": "r"}
            if role == "assistant"
            else {}
        ),
    }
    for role, text in (
        ("user", "u1"),
        ("assistant", "<think>t</think>a1"),
        ("user", "u2"),
        ("assistant", ""),
        ("tool", "r1"),
        ("assistant", "<think>t</think>"),
        ("tool", "r2"),
        ("tool", "r3"),
        ("assistant", "a3"),
        ("user", "u4"),
        ("assistant", "a4"),
        ("user", "u5"),
        ("assistant", "a5"),
    )
]
_PROBE[3]["tool_calls"], _PROBE[5]["tool_calls"] = (
    [tool_call(c, "f", {"x": 1}) for c in ids] for ids in (["c1"], ["c2", "c3"])
)


def content_parts(parts: list[dict[str, Any]], image: Any) -> str | list[dict[str, Any]]:
    """OpenAI content parts -> canonical content: their text, or with images the list of the module docstring."""
    if all(p.get("type") not in ("image_url", "image") for p in parts):
        return "".join(p.get("text") or "" for p in parts)
    out = []
    for p in parts:
        if p.get("type") == "image_url":
            p = {"type": "image", "image": image(p["image_url"]["url"])}
        elif p.get("type") != "image":
            p = {"type": "text", "text": p.get("text") or ""}
        out.append(p)
    return out


def message_images(messages: list[dict[str, Any]]) -> list[ImageRef]:
    """The images of canonical messages, in order."""
    return [
        p["image"]
        for m in messages
        if isinstance(m["content"], list)
        for p in m["content"]
        if p["type"] == "image"
    ]


def canonical_messages(
    messages: list[dict[str, Any]], image: Callable[[str], ImageRef] | None = None, raw: Collection[str] = ()
) -> list[dict[str, Any]]:
    """OpenAI-format chat messages (plain dicts) -> canonical messages; `image` loads an image_url (a
    `ChatRenderer.image`); calls to the tools in `raw` (grammar tools) keep their input as the string it is.
    Idempotent."""
    out = []
    for m in messages:
        role = "system" if m["role"] == "developer" else m["role"]
        content = m.get("content")
        if isinstance(content, list):  # content parts
            content = content_parts(content, image)
        msg: dict[str, Any] = {"role": role, "content": content or ""}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = [
                tool_call(
                    c.get("id") or "",
                    c["function"]["name"],
                    c["function"].get("arguments") or "",
                    c["function"]["name"] in raw,
                )
                for c in m["tool_calls"]
            ]
        if role == "tool":
            msg["tool_call_id"] = m.get("tool_call_id") or ""
            if m.get("name"):
                msg["name"] = m["name"]
        out.append(msg)
    return out


def merge_leading_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Leading system messages as one (instructions plus a system item, a system prompt plus a system-role
    message): templates place a system prompt only first."""
    while len(messages) > 1 and messages[0]["role"] == messages[1]["role"] == "system":
        messages[:2] = [
            {"role": "system", "content": f"{messages[0]['content']}\n\n{messages[1]['content']}"}
        ]
    return messages


def canonical_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """OpenAI-format tool definitions; an empty list means no tools (OpenAI itself rejects `tools=[]`)."""
    if not tools:
        return None
    return [
        {"type": "function", "function": {k: v for k, v in t["function"].items() if v is not None}}
        for t in tools
    ]
