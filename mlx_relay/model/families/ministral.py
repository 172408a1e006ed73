"""Ministral 3 and Mistral 4: layers take (x, attn_scale, mask, cache); Mistral 4's
forward computes the scale by position (llama 4's log scaling past the original
context) from the step's offset."""

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlx_relay.model.families.base import FamilyAdapter


def _llama4_scale(args: Any, h: mx.array, c: Any) -> mx.array:
    """From this layer's cache, whose offset is the step's, as ministral3's attention
    does itself when given none."""
    from mlx_lm.models.ministral3 import _get_llama_4_attn_scale

    rope = args.rope_parameters
    offset = c.offset if c is not None else 0
    return _get_llama_4_attn_scale(
        h.shape[1], offset, rope["llama_4_scaling_beta"], rope["original_max_position_embeddings"]
    ).astype(h.dtype)


def _mistral4_call(layer: Any, h: mx.array, mask_for: Callable[[Any], Any], c: Any) -> mx.array:
    return layer(h, _llama4_scale(layer.self_attn.args, h, c), mask_for(c), c)


ADAPTERS = (
    FamilyAdapter(
        names=("ministral3",),
        layer_call=lambda layer, h, mask_for, c: layer(h, None, mask_for(c), c),
    ),
    FamilyAdapter(names=("mistral4",), layer_call=_mistral4_call),
)
