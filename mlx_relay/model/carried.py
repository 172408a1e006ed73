"""A second hidden state that some families' layers take besides h, carried with it.

talkie's blocks each add the normed token embedding (`e_x`, with a learned gain);
rwkv7's layers after the first mix in the first layer's values (`v_first`). Both are
made on rank 0 (from the embedding, or by layer 0, which rank 0 always holds) and read
by every later layer, on whatever rank it is. So they travel with h, folded into the
payload's width as gemma3n's AltUp streams are (altup.py): (batch, tokens, 2 x hidden),
h first. Rank 0 pairs h with its companion after the embedding (`pair`), every rank
runs its layers on the pair as the family's forward does (`run_layers`), and the head
reads h alone (`hidden`). Splitting and joining only move values, so a stage computes
exactly what the whole model computes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

FAMILIES = ("talkie", "rwkv7")


def pair(family: str, h: mx.array) -> mx.array:
    """The embedding h with its companion, folded: talkie's is h itself (its forward
    norms the embedding, then keeps it as e_x); rwkv7's is zeros, as layer 0 makes
    v_first and reads none."""
    companion = h if family == "talkie" else mx.zeros_like(h)
    return mx.concatenate([h, companion], axis=-1)


def _split(x: mx.array) -> tuple[mx.array, mx.array]:
    width = x.shape[-1] // 2
    return mx.contiguous(x[..., :width]), mx.contiguous(x[..., width:])


def hidden(x: mx.array) -> mx.array:
    """h of a folded pair (what the final norm and head read)."""
    return _split(x)[0]


def run_layers(
    family: str,
    layers: list[Any],
    x: mx.array,
    caches: list[Any],
    mask_for: Callable[[Any], Any],
) -> mx.array:
    """The layers on a folded pair, each called as the family's forward calls it."""
    h, companion = _split(x)
    if family == "talkie":
        for layer, cache in zip(layers, caches, strict=True):
            h = layer(companion, h, mask_for(cache), cache)
        return mx.concatenate([h, companion], axis=-1)
    # rwkv7: v_first is (batch, tokens, heads, head_dim), heads x head_dim = hidden
    if not layers:
        return x
    shape = (*companion.shape[:2], layers[0].attn.num_heads, layers[0].attn.head_dim)
    v_first = companion.reshape(shape)
    for layer, cache in zip(layers, caches, strict=True):  # (no mask: recurrent state)
        h, v_first = layer(h, v_first, cache)
    return mx.concatenate([h, v_first.reshape(companion.shape)], axis=-1)
