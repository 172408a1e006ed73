"""What some families' layers take besides h, carried with it between ranks.

talkie's blocks each add the normed token embedding (`e_x`, with a learned gain);
rwkv7's layers after the first mix in the first layer's values (`v_first`); Kimi K3's
layers mix h with the outputs of earlier blocks of layers (attention residuals: one
stored hidden state per block of `attn_res_block_size` layers so far, and its final
norm reads a mix of them all). Each is made on a rank and read by layers on later
ranks, so it travels with h, folded into the payload's width as gemma3n's AltUp
streams are (altup.py): (batch, tokens, k x hidden), h first, then the carried states
in order. Kimi K3's k grows by one at each block start, so a hop after more blocks is
wider; a receiving rank learns k from the width. Rank 0 folds the embedding (`start`),
every rank runs its layers on the folded state as the family's forward does
(`run_layers`), and the head reads the h the final norm gets (`final`). Folding and
unfolding only move values, so a stage computes exactly what the whole model computes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import mlx.core as mx

FAMILIES = ("talkie", "rwkv7", "kimi_k3")


def _fold(parts: list[mx.array]) -> mx.array:
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


def _unfold(x: mx.array, width: int) -> list[mx.array]:
    """(batch, tokens, k x width) -> k arrays (batch, tokens, width)."""
    if x.shape[-1] == width:
        return [x]
    return [mx.contiguous(x[..., i : i + width]) for i in range(0, x.shape[-1], width)]


def start(family: str, h: mx.array) -> mx.array:
    """The folded state before the first layer, from the embedding h: talkie's
    companion is h itself (its forward norms the embedding, then keeps it as e_x);
    rwkv7's is zeros, as layer 0 makes v_first and reads none; Kimi K3 has no block yet."""
    if family == "talkie":
        return _fold([h, h])
    if family == "rwkv7":
        return _fold([h, mx.zeros_like(h)])
    return h


def width_after(family: str, inner: Any, layers_done: int, width: int) -> int:
    """The folded state's width after the model's first `layers_done` layers, where a
    state of `width` entered them: Kimi K3 with attention residuals holds h and one
    state per block begun so far (a block begins at every attn_res_block_size-th
    layer); every other family's width does not change."""
    if family != "kimi_k3" or not inner.use_attn_res:
        return width
    args = inner.args
    return (1 + math.ceil(layers_done / args.attn_res_block_size)) * args.hidden_size


def final(family: str, inner: Any, x: mx.array) -> mx.array:
    """The h the final norm reads: h itself, or for Kimi K3 with attention residuals
    its mix with every block's state, as its forward computes it on the last rank."""
    width = inner.args.hidden_size if family == "kimi_k3" else x.shape[-1] // 2
    h, *_ = parts = _unfold(x, width)
    if family != "kimi_k3" or not inner.use_attn_res:
        return h
    from mlx_lm.models.kimi_k3 import _attn_res_mix

    blocks = _residual_blocks(inner, parts[1:])
    if inner._output_res_w_eff is None:  # (as its forward caches it)
        inner._output_res_w_eff = inner.output_attn_res_norm.weight.astype(
            mx.float32
        ) * inner.output_attn_res_proj.weight.reshape(-1)
    return _attn_res_mix(blocks, h, inner._output_res_w_eff, inner.args.rms_norm_eps, True)


def _residual_blocks(inner: Any, raw: list[mx.array]) -> Any:
    """Kimi K3's ResidualBlocks holding these blocks' states, their inverse RMS
    computed as its pipeline's receiving rank computes them."""
    from mlx_lm.models.kimi_k3 import ResidualBlocks

    blocks = ResidualBlocks(inner.args.rms_norm_eps)
    if raw:
        blocks.raw = mx.stack(raw)
        xf = blocks.raw.astype(mx.float32)
        blocks.inv_rms = mx.rsqrt((xf * xf).mean(axis=-1) + inner.args.rms_norm_eps)
    return blocks


def run_layers(
    family: str,
    inner: Any,
    layers: list[Any],
    x: mx.array,
    caches: list[Any],
    mask_for: Callable[[Any], Any],
) -> mx.array:
    """The layers on a folded state, each called as the family's forward calls it."""
    if family == "kimi_k3":
        h, *raw = _unfold(x, inner.args.hidden_size)
        blocks = _residual_blocks(inner, raw) if inner.use_attn_res else None
        for layer, cache in zip(layers, caches, strict=True):
            h, blocks = layer(h, mask=mask_for(cache), cache=cache, blocks=blocks)
        if blocks is None or blocks.raw is None:
            return h
        return _fold([h, *(blocks.raw[i] for i in range(blocks.raw.shape[0]))])
    h, companion = _unfold(x, x.shape[-1] // 2)
    if family == "talkie":
        for layer, cache in zip(layers, caches, strict=True):
            h = layer(companion, h, mask_for(cache), cache)
        return _fold([h, companion])
    # rwkv7: v_first is (batch, tokens, heads, head_dim), heads x head_dim = hidden
    if not layers:
        return x
    shape = (*companion.shape[:2], layers[0].attn.num_heads, layers[0].attn.head_dim)
    v_first = companion.reshape(shape)
    for layer, cache in zip(layers, caches, strict=True):  # (no mask: recurrent state)
        h, v_first = layer(h, v_first, cache)
    return _fold([h, v_first.reshape(companion.shape)])
