"""What the engines and the trainer share about a Hugging Face model: its description read from its config files
(`ModelSpec`), the positions of a multimodal RoPE, and the logits' matmul that neither side rounds differently.

Layer 0 beside `molt.types`: it imports nothing of molt."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any


def rope_positions(
    model: Any, ids: Any, mask: Any, positions: Any, images: dict | None
) -> tuple[Any, list[int]]:
    """(position ids, per-row offsets) of a forward over `ids` [B, L] (`mask` [B, >= L], a cached prefix's
    columns first). A model whose positions depend on its images (Qwen2-VL's M-RoPE): [3, B, L] by its own
    `get_rope_index` (the tokens' modalities read off the placeholder ids, as its processor does), a row's next
    position being its length + offset; rows without images keep `positions` unless None. Other models or no
    images: (`positions`, zeros)."""
    get = getattr(getattr(model, "model", model), "get_rope_index", None)  # a full model or its base model
    if get is None or not images:
        return positions, [0] * len(ids)
    kinds = (ids == model.config.image_token_id).int() + 2 * (ids == model.config.video_token_id).int()
    rope, offsets = get(
        ids,
        kinds,
        image_grid_thw=images.get("image_grid_thw"),
        video_grid_thw=images.get("video_grid_thw"),
        attention_mask=mask[:, -ids.shape[1] :],
    )
    plain = ~kinds.bool().any(1)
    if positions is not None:
        rope[:, plain] = positions[plain].to(rope.device)
    return rope, offsets[:, 0].tolist()


def mm_f32(a: Any, b: Any) -> Any:
    """a @ b in the inputs' dtype (bf16 tensor cores on CUDA) with fp32 accumulation, as an fp32 result, not
    rounded to bf16 first where the device has the kernel (CUDA's `mm` with `out_dtype`). The trainer's log-prob
    head and the engine's output head both compute logits this way, so neither rounds them and the other not."""
    import torch

    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda and _mm_has_out_dtype():
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


@functools.cache
def _mm_has_out_dtype() -> bool:
    """Whether this torch has `mm(a, b, out_dtype=...)` (asked once: mm_f32 runs per chunk and per decode step)."""
    import torch

    return "dtype" in torch.ops.aten.mm.overloads()


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What engines, capture and the trainer need to know about a checkpoint, read once from its config files
    (no weights, no modeling code): one description instead of each room probing the config its own way."""

    vision: bool  # a vision-language model (the config has a vision tower): AutoModelForImageTextToText, AutoProcessor
    eos_token_ids: tuple[int, ...]  # generation config's (generation_config.json, else the model config's)
    pad_token_id: int  # generation config's, else the first EOS, else 0
    # a VLM's image/video placeholder and marker ids: never sampled nor trained (docs/vision.md)
    banned: tuple[int, ...]
    image_token_id: int | None  # the image placeholder (LLaVA's `image_token_index`)
    merge_size: int  # image patches merged per side into one token (Qwen2-VL's `spatial_merge_size`; else 1)
    max_model_len: int  # context window: the text config's max_position_embeddings
    vocab_size: int
    # dynamic or long RoPE: a Python `if` on the largest position (a host sync, no CUDA graphs)
    dynamic_rope: bool
    sliding: bool  # some layer attends over a sliding window only
    config: Any = field(repr=False, compare=False, default=None)  # the transformers config it was read from

    @classmethod
    def from_pretrained(cls, path: Any) -> ModelSpec:
        from transformers import AutoConfig, GenerationConfig

        try:
            generation = GenerationConfig.from_pretrained(path)
        except OSError:  # no generation_config.json: derived from the model config, as transformers does
            generation = None
        return cls.from_config(AutoConfig.from_pretrained(path), generation)

    @classmethod
    def from_config(cls, config: Any, generation: Any = None) -> ModelSpec:
        from transformers import GenerationConfig

        text, generation = config.get_text_config(), generation or GenerationConfig.from_model_config(config)
        eos = generation.eos_token_id if generation.eos_token_id is not None else text.eos_token_id
        eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        pad = generation.pad_token_id if generation.pad_token_id is not None else (*eos, 0)[0]
        banned = {
            v
            for k, v in config.to_dict().items()  # LLaVA's image_token_index, Qwen2-VL's vision_start_...
            if re.fullmatch(r"(image|video|vision)\w*_token_(id|index)", k) and isinstance(v, int) and v >= 0
        }
        rope = getattr(text, "rope_parameters", None) or {}  # one dict, or one per layer type
        kinds = {rope.get("rope_type")} | {v.get("rope_type") for v in rope.values() if isinstance(v, dict)}
        layers = getattr(text, "layer_types", None)
        sliding = (
            "sliding_attention" in layers
            if layers
            else bool(getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True))
        )
        return cls(
            vision=hasattr(config, "vision_config"),
            eos_token_ids=eos,
            pad_token_id=int(pad),
            banned=tuple(sorted(banned)),
            image_token_id=getattr(config, "image_token_id", None)
            or getattr(config, "image_token_index", None),
            merge_size=getattr(getattr(config, "vision_config", None), "spatial_merge_size", 1),
            max_model_len=int(text.max_position_embeddings),
            vocab_size=int(text.vocab_size),
            dynamic_rope=bool(kinds & {"dynamic", "longrope"}),
            sliding=sliding,
            config=config,
        )

    @property
    def auto_class(self) -> Any:
        import transformers as tf

        return tf.AutoModelForImageTextToText if self.vision else tf.AutoModelForCausalLM

    @property
    def cache_kw(self) -> str:
        """The forward's KV-cache keyword: transformers 5.x renamed `past_key_values` to `cache`."""
        import inspect

        forward = self.auto_class._model_mapping[type(self.config)].forward
        return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
