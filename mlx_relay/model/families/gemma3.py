"""Gemma 3: its sqrt(hidden) factor rounded to bfloat16 first; sliding windows on all
but every `sliding_window_pattern`-th layer."""

from typing import Any

import mlx.core as mx

from mlx_relay.model.families.base import FamilyAdapter


def _embed(a: Any, h: mx.array) -> mx.array:
    """gemma3 rounds its sqrt(hidden) factor to bfloat16 first (vision.py scales an image
    prompt's merged embeddings the same way)."""
    return h * mx.array(a.hidden_size**0.5, mx.bfloat16).astype(h.dtype)


# gemma3: its vision-language model, whose decode steps embed tokens here
ADAPTERS = (
    FamilyAdapter(
        names=("gemma3_text", "gemma3"),
        embed_op=_embed,
        kv_cache="attention",
        sliding_pattern=True,
    ),
)
