"""Qwen2-VL and Qwen2.5-VL (mlx-vlm): multimodal rope, positions rank 0 computes from
the image grid and sends (step_inputs.py); each layer takes the position ids and the
rope's cos/sin."""

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlx_relay.model import step_inputs
from mlx_relay.model.families.base import FamilyAdapter


def _mrope_call(
    layer: Any, h: mx.array, mask_for: Callable[[Any], Any], c: Any, **kw: Any
) -> mx.array:
    return layer(h, mask_for(c), c, kw["position_ids"], kw["position_embeddings"])


ADAPTERS = (
    FamilyAdapter(
        names=("qwen2_vl", "qwen2_5_vl"), layer_call=_mrope_call, layer_inputs=step_inputs.mrope
    ),
)
