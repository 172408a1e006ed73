"""What some families' layers take besides h, carried with it between ranks.

talkie's blocks each add the normed token embedding (`e_x`, with a learned gain);
rwkv7's layers after the first mix in the first layer's values (`v_first`); Kimi K3's
layers mix h with the outputs of earlier blocks of layers (attention residuals: one
stored hidden state per block of `attn_res_block_size` layers so far, and its final
norm reads a mix of them all); Hunyuan-Large's layers share keys and values in groups
of `cla_share_factor` (cross-layer attention: the first layer of a group projects
them, the others reuse them, within the step). Each is made on a rank and may be read
by layers on later ranks, so it travels with h, folded into the payload's width as
gemma3n's AltUp streams are (altup.py): (batch, tokens, width), h first, then the
carried states in order. Kimi K3's state grows by one hidden state at each block
start, so a hop after more blocks is wider; Hunyuan's carries the group's keys and
values only where a hop parts a group. DeepSeek V4.1's hyper-connection streams and
the state its layers share are laid out in deepseek_v4.py. Rank 0 folds the embedding (`start`),
every rank runs its layers on the folded state as the family's forward does
(`run_layers`), and the head reads the h the final norm gets (`final`). Folding and
unfolding only move values, so a stage computes exactly what the whole model computes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlx_relay.model import deepseek_v4

FAMILIES = ("talkie", "rwkv7", "kimi_k3", "hunyuan", deepseek_v4.FAMILY)


def _fold(parts: list[mx.array]) -> mx.array:
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


def _unfold(x: mx.array, width: int, *widths: int) -> list[mx.array]:
    """(batch, tokens, total) -> arrays (batch, tokens, width), then of `widths` each if
    given, else of `width` each."""
    if x.shape[-1] == width:
        return [x]
    widths = widths or (width,) * (x.shape[-1] // width - 1)
    bounds = [0, width]
    for w in widths:
        bounds.append(bounds[-1] + w)
    return [mx.contiguous(x[..., a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]


def _cla_open(args: Any, layers_done: int) -> bool:
    """Whether Hunyuan's cross-layer attention group is still open after the model's
    first `layers_done` layers: its next layer reuses keys and values made before."""
    return (
        bool(args.use_cla)
        and layers_done % args.cla_share_factor != 0
        and layers_done < args.num_hidden_layers
    )


def _kv_width(args: Any) -> int:
    """The width of one of Hunyuan's shared keys or values (before the heads split)."""
    return args.num_key_value_heads * (args.hidden_size // args.num_attention_heads)


def start(family: str, inner: Any, h: mx.array) -> mx.array:
    """The folded state before the first layer, from the embedding h: talkie's
    companion is h itself (its forward norms the embedding, then keeps it as e_x);
    rwkv7's is zeros, as layer 0 makes v_first and reads none; Kimi K3 has no block yet."""
    if family == "talkie":
        return _fold([h, h])
    if family == "rwkv7":
        return _fold([h, mx.zeros_like(h)])
    if family == deepseek_v4.FAMILY:
        return deepseek_v4.start(inner.args, h)
    return h


def probe_state(family: str, inner: Any, first: int, h: mx.array) -> mx.array:
    """Zeros of the state entering the model's layer `first` in a first step of h's
    tokens, for a probe run (h: zeros of the hidden state's shape)."""
    if family in ("talkie", "rwkv7"):
        return _fold([h, h])
    if family == deepseek_v4.FAMILY:
        return deepseek_v4.probe_state(inner.args, first, h)
    width = width_after(family, inner, first, h.shape[-1])
    return mx.zeros((*h.shape[:2], width), h.dtype)


def width_after(family: str, inner: Any, layers_done: int, width: int) -> int:
    """The folded state's width after the model's first `layers_done` layers, where a
    state of `width` entered them: Kimi K3 with attention residuals holds h and one
    state per block begun so far (a block begins at every attn_res_block_size-th
    layer); Hunyuan's holds the open group's keys and values after h; every other
    family's width does not change."""
    if family == "hunyuan":
        args = inner.args
        return args.hidden_size + (2 * _kv_width(args) if _cla_open(args, layers_done) else 0)
    if family == deepseek_v4.FAMILY:
        return deepseek_v4.width_after(inner.args, layers_done, width)
    if family != "kimi_k3" or not inner.use_attn_res:
        return width
    args = inner.args
    return (1 + math.ceil(layers_done / args.attn_res_block_size)) * args.hidden_size


def final(family: str, inner: Any, x: mx.array) -> mx.array:
    """The h the final norm reads: h itself, or for Kimi K3 with attention residuals
    its mix with every block's state, as its forward computes it on the last rank."""
    if family in ("hunyuan", deepseek_v4.FAMILY):  # (no group open; streams collapsed)
        return x
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
    first: int,
    layers: list[Any],
    x: mx.array,
    caches: list[Any],
    mask_for: Callable[[Any], Any],
) -> mx.array:
    """The layers (the model's from index `first` on) on a folded state, each called as
    the family's forward calls it."""
    if family == "hunyuan":
        return _hunyuan_layers(inner.args, first, layers, x, caches, mask_for)
    if family == deepseek_v4.FAMILY:  # (no masks: its attention reads its own windows)
        return deepseek_v4.run_layers(inner, first, layers, x, caches)
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


def _hunyuan_layers(
    args: Any,
    first: int,
    layers: list[Any],
    x: mx.array,
    caches: list[Any],
    mask_for: Callable[[Any], Any],
) -> mx.array:
    """Hunyuan's layers as its forward runs them: a group's first layer projects keys and
    values, the others reuse them (received with h where the group began on a rank
    before this one; sent on where it goes on after this rank's last layer)."""
    h, *shared = _unfold(x, args.hidden_size, _kv_width(args), _kv_width(args))
    kv_states = tuple(shared) or None
    for i, (layer, cache) in enumerate(zip(layers, caches, strict=True), start=first):
        if not args.use_cla or i % args.cla_share_factor == 0:
            kv_states = None
        h, kv_states = layer(h, mask_for(cache), cache, kv_states)
    if _cla_open(args, first + len(layers)):
        return _fold([h, *kv_states])
    return h
