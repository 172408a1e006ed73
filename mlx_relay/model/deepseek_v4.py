"""DeepSeek V4.1 (mlx-lm's `deepseek_v41`) split over ranks: what crosses a hop.

Its layers pass on not one hidden state but `hc_mult` hyper-connection streams and the
weights of the next collapse of them (`pre_mix`), and they share state within a step
through a dict: compressed keys and values and their index keys (each growing by a
whole group of `compress_ratios[layer]` positions at a time), the indexer's top-k
picks and its candidate blocks. Which of these the layers after a hop read from the
layers before it follows from the config (mlx-lm's `_crossing`), and their shapes from
the step's first position and length, which every rank knows. So they travel folded
into the payload's width after the streams, in the streams' dtype: `pre_mix` (float32)
and the picks (int32) by their bits, the candidate flags as 0 and 1, the compressed
rows that are new this step padded to the step's length. As in mlx-lm's own pipeline,
a rank keeps the compressed rows it received in its first layer's cache (a layer that
never writes them), and the rank holding the last layer collapses the streams into the
hidden state the final norm reads.

Its LayerCache has no batch form, so a decode group runs row by row (its adapter's
`row_by_row`: families/deepseek.py): each row is laid out by its own position, and rows
are padded to the widest.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
from mlx_lm.models import deepseek_v41 as ds

FAMILY = "deepseek_v41"
_CACHE_FIELDS = ("compress_kv", "index_k")  # (grow each step: new rows only)


def _bits(a: mx.array, dtype: mx.Dtype) -> mx.array:
    """`a`'s bits read as `dtype` (the last axis scaled by the size ratio)."""
    return a if a.dtype == dtype else mx.contiguous(a).view(dtype)


def _new_rows(args: Any, source: int, start_pos: int, length: int) -> int:
    """The compressed rows source layer `source` adds in a step of `length` from
    `start_pos`."""
    return ds._entries(args, source, start_pos + length) - ds._entries(args, source, start_pos)


def _layout(
    args: Any, crossing: dict[str, int], length: int, start_pos: int, dtype: mx.Dtype
) -> list[tuple[str, int]]:
    """(part, width in `dtype` values) of a hop's folded state, in order."""
    end = start_pos + length
    layout = [
        ("streams", args.hc_mult * args.hidden_size),
        ("pre_mix", args.hc_mult * 4 // dtype.size),
    ]
    for key, source in crossing.items():
        if key == "compress_kv":
            layout.append((key, args.head_dim))
        elif key == "index_k":
            layout.append((key, args.index_head_dim))
        elif key == "candidates":
            keys = ds._index_keys(args, source, end)
            layout.append((key, math.ceil(keys / args.candidate_block_size)))
        else:  # topk_idx
            topk = min(args.index_topk, ds._index_keys(args, source, end))
            layout.append((key, topk * 4 // dtype.size))
    return layout


def start(args: Any, h: mx.array) -> mx.array:
    """The state before the first layer, as its forward makes it from the embedding:
    every stream is h, and the first collapse takes stream 0."""
    batch, length, hidden = h.shape
    streams = mx.broadcast_to(h[:, :, None, :], (batch, length, args.hc_mult, hidden))
    pre_mix = mx.zeros((batch, length, args.hc_mult), dtype=mx.float32)
    pre_mix[..., 0] = 1.0
    folded = streams.reshape(batch, length, args.hc_mult * hidden)
    return mx.concatenate([folded, _bits(pre_mix, h.dtype)], axis=-1)


def probe_state(args: Any, first: int, h: mx.array) -> mx.array:
    """Zeros of the state entering layer `first` in a first step of h's tokens."""
    crossing = ds._crossing(args, first)
    width = sum(w for _, w in _layout(args, crossing, h.shape[1], 0, h.dtype))
    return mx.zeros((*h.shape[:2], width), h.dtype)


def width_after(args: Any, layers_done: int, width: int) -> int:
    """After the last layer, the collapsed hidden state; before it, the width depends on
    the step (`_layout`): `width` stands for it."""
    return args.hidden_size if layers_done >= args.num_hidden_layers else width


def run_layers(inner: Any, first: int, layers: list[Any], x: mx.array, caches: list[Any]) -> Any:
    """The model's layers from index `first` on a folded state, as its forward runs
    them; the folded state for the next rank, or the collapsed hidden state after the
    model's last layer."""
    args = inner.args
    batch, length, _ = x.shape
    own = caches[0]
    start_pos = own.offset  # (every layer's cache holds the same positions)
    previous = 0 if own.window is None else own.window.shape[1]
    window_idx = ds._window_indices(previous=previous, length=length, window=args.sliding_window)
    window_idx = mx.broadcast_to(window_idx, (batch, *window_idx.shape))
    shared: dict[str, Any] = {}
    streams, pre_mix = _receive(args, x, first, start_pos, own, shared)
    for layer, cache in zip(layers, caches, strict=True):
        streams, pre_mix = layer(
            streams,
            pre_mix,
            start_pos=start_pos,
            window_idx=window_idx,
            cache=cache,
            shared=shared,
        )
    end = first + len(layers)
    if end >= args.num_hidden_layers:
        return ds._collapse(streams, pre_mix)
    return _send(args, streams, pre_mix, end, start_pos, shared)


def _receive(
    args: Any, x: mx.array, first: int, start_pos: int, own: Any, shared: dict[str, Any]
) -> tuple[mx.array, mx.array]:
    """The streams and pre_mix from a folded state; what the layers from `first` on
    read of the layers before them into `shared` (compressed rows into `own`)."""
    batch, length, _ = x.shape
    crossing = ds._crossing(args, first)
    parts: dict[str, mx.array] = {}
    at = 0
    for key, width in _layout(args, crossing, length, start_pos, x.dtype):
        parts[key] = x[..., at : at + width]
        at += width
    if at > x.shape[-1]:
        raise ValueError(f"a state of width {x.shape[-1]} where layer {first} needs {at}")
    streams = mx.contiguous(parts["streams"]).reshape(batch, length, args.hc_mult, args.hidden_size)
    pre_mix = _bits(parts["pre_mix"], mx.float32)
    for key, source in crossing.items():
        part = parts[key]
        if key in _CACHE_FIELDS:
            new = _new_rows(args, source, start_pos, length)
            if new:  # (this rank's first layer never writes the field itself)
                rows = mx.contiguous(part[:, :new])
                setattr(own, key, ds._append(getattr(own, key), rows))
            shared[key] = getattr(own, key)
        elif key == "candidates":
            keys = ds._index_keys(args, source, start_pos + length)
            flags = mx.repeat(part.astype(mx.bool_), args.candidate_block_size, axis=-1)
            shared[key] = flags[..., :keys] if keys else None
        else:  # topk_idx
            shared[key] = _bits(part, mx.int32)
    return streams, pre_mix


def _send(
    args: Any,
    streams: mx.array,
    pre_mix: mx.array,
    end: int,
    start_pos: int,
    shared: dict[str, Any],
) -> mx.array:
    """The folded state for the rank holding layers from `end` on."""
    batch, length = streams.shape[:2]
    dtype = streams.dtype
    crossing = ds._crossing(args, end)
    parts = [streams.reshape(batch, length, -1), _bits(pre_mix, dtype)]
    for key, width in _layout(args, crossing, length, start_pos, dtype)[2:]:
        part = shared.get(key)
        if key in _CACHE_FIELDS:
            new = _new_rows(args, crossing[key], start_pos, length)
            rows = (
                mx.zeros((batch, 0, width), dtype)
                if part is None
                else part[:, part.shape[1] - new :]
            )
            part = mx.pad(rows, [(0, 0), (0, length - new), (0, 0)])
        elif key == "candidates":
            flags = part[..., :: args.candidate_block_size] if part is not None else None
            part = mx.zeros((batch, length, width), dtype) if flags is None else flags
        else:  # topk_idx
            picks = mx.zeros((batch, length, width * dtype.size // 4), mx.int32)
            part = _bits(picks if part is None else part, dtype)
        if part.shape != (batch, length, width):
            raise ValueError(f"{key} for layer {end} on: {part.shape}, expected {width} wide")
        if part.dtype != dtype and key in _CACHE_FIELDS:
            raise ValueError(f"{key} is {part.dtype}, the streams {dtype}")
        parts.append(part.astype(dtype))
    return mx.concatenate(parts, axis=-1)
