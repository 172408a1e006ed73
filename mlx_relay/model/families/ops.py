"""Operations several families' forwards share, written as those forwards write them."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlx_relay.model.families.base import Op


def softcap(cap: float | None, x: mx.array) -> mx.array:
    """tanh(x / cap) * cap, or x where the config sets no cap."""
    return mx.tanh(x / cap) * cap if cap else x


def scale_by_root(a: Any, h: mx.array) -> mx.array:
    """The embedding times sqrt(hidden_size), as a Python float (gemma, gemma2, gemma4)."""
    return h * (a.hidden_size**0.5)


def weightless_norm(a: Any, h: mx.array) -> mx.array:
    """An RMS norm without a weight, at the model's eps (muse_glimmer's embedding,
    talkie's embedding and final norm)."""
    return mx.fast.rms_norm(h, None, a.rms_norm_eps)


def own_softcap(module: str, name: str = "logit_softcap") -> Op:
    """A family's own compiled soft-cap function of the final_logit_softcapping its
    args give, so that its logits stay bit-identical."""

    def op(a: Any, x: mx.array) -> mx.array:
        fn = getattr(importlib.import_module(f"mlx_lm.models.{module}"), name)
        cap = a.final_logit_softcapping
        return fn(cap, x) if cap is not None else x

    return op


def keyword_call(
    layer: Any, h: mx.array, mask_for: Callable[[Any], Any], c: Any, **kw: Any
) -> mx.array:
    """`layer(h, mask, cache, **step inputs)`."""
    return layer(h, mask_for(c), c, **kw)
