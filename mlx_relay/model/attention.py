"""Attention for steps of a few positions (speculative verify steps) on CUDA, unfused.

MLX's CUDA backend runs attention over more than one query position through cuDNN,
whose graphs it caches by the exact shapes, key length included. A verify step carries
k + 1 positions at a key length no earlier step had (the sequence moved on by what the
last round kept), so every verify step built a new cuDNN graph: on an H100 a 5-position
step of the Llama-3-8B shape took 68 ms the first time at an offset and 26 ms when the
same offsets came again (`bench/verify_loop.py`, bench/RESULTS.md). The unfused form
(two matmuls and a softmax, what MLX itself falls back to where cuDNN cannot serve)
builds nothing per length: 29 ms every time. So on CUDA a verify step's layers, and the
draft model's multi-token steps, are built with `mx.fast.scaled_dot_product_attention`
swapped for `attend` below while their graph is built (the models look the function up
at each call). Metal's kernels for a few queries are not built per key length, and the
CPU has no fused kernel: there nothing changes. CUDA-only, then, and the results differ
from the fused kernel's only by float rounding (greedy tokens can differ at near ties
from mlx-lm's speculative generator on CUDA). `MLX_RELAY_VERIFY_ATTENTION=fused` keeps
MLX's own on CUDA too.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

import mlx.core as mx

from mlx_relay.device import on_cuda

ENV = "MLX_RELAY_VERIFY_ATTENTION"
FEW = 32  # (more query positions than this, a prompt's chunk: MLX's own kernel)

_fused = mx.fast.scaled_dot_product_attention


@functools.cache
def wanted() -> bool:
    """Whether verify steps swap in the unfused attention here (CUDA, unless told not;
    asked once a process)."""
    return on_cuda() and os.environ.get(ENV, "unfused") != "fused"


@contextlib.contextmanager
def unfused(active: bool = True) -> Iterator[None]:
    """While the graph of a few-position step is built: `attend` in MLX's place (the
    thread building graphs is the only one that calls it: the engine's on rank 0, the
    loop's on a worker)."""
    if not active:
        yield
        return
    mx.fast.scaled_dot_product_attention = attend
    try:
        yield
    finally:
        mx.fast.scaled_dot_product_attention = _fused


def attend(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: Any = None,
    sinks: mx.array | None = None,
    stream: Any = None,
) -> mx.array:
    """softmax(q k^T * scale + mask) v for (B, H, L, D) queries over (B, Hkv, S, D) keys,
    Hkv dividing H; `mask` None, "causal" (the last L keys are the queries' own) or an
    array (boolean: True attends; else added), broadcastable to (B, H, L, S). A single
    query position, many of them, or attention sinks: MLX's own kernel."""
    n_q, n_kv, length = q.shape[1], k.shape[1], q.shape[2]
    if length == 1 or length > FEW or sinks is not None or stream is not None:
        return _fused(q, k, v, scale=scale, mask=mask, sinks=sinks, stream=stream)
    keys = k.shape[2]
    repeats = n_q // n_kv
    queries = (q * scale).reshape(q.shape[0], n_kv, repeats, length, q.shape[-1])
    scores = queries @ mx.expand_dims(k, 2).swapaxes(-1, -2)  # (B, Hkv, rep, L, S)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"attention mask {mask!r}: expected 'causal' or an array")
        mask = mx.arange(keys - length, keys)[:, None] >= mx.arange(keys)[None]
    if mask is not None:
        mask = _grouped(mask, n_kv, repeats)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask.astype(scores.dtype)
    weights = mx.softmax(scores, axis=-1, precise=True)
    out = weights @ mx.expand_dims(v, 2)  # (B, Hkv, rep, L, Dv)
    return out.reshape(q.shape[0], n_q, length, v.shape[-1])


def _grouped(mask: mx.array, n_kv: int, repeats: int) -> mx.array:
    """A mask broadcastable to (B, H, L, S) as one broadcastable to (B, Hkv, rep, L, S)."""
    if mask.ndim < 3 or mask.shape[-3] == 1:
        return mx.expand_dims(mask, -3)
    return mask.reshape(*mask.shape[:-3], n_kv, repeats, *mask.shape[-2:])
