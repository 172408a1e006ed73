"""gemma3n's AltUp streams, as the hidden state that travels between ranks.

gemma3n's layers do not pass one hidden state on but `altup_num_inputs` streams
(n, batch, tokens, hidden): its forward makes them from the embedding before the first
layer (stream 0 is the embedding itself, the others its projections scaled to its
magnitude) and merges them back into one before the final norm. A step's payload is
(batch, tokens, width), so the streams travel folded into the width, (batch, tokens,
n * hidden), stream after stream: rank 0 expands before its first layer (`expand`),
every rank unfolds them for its layers and folds their output (`unfold`, `fold`), and
rank 0 merges before the head (`merge`). `expand` and `merge` are the model's own
forward's code (mlx_lm.models.gemma3n.LanguageModel.__call__), on the decoder's own
projections, so a stage computes exactly what the whole model computes; fold and unfold
only move values.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

# Families whose hidden state between layers is AltUp streams.
FAMILIES = ("gemma3n",)


def streams(inner: Any) -> int:
    """How many streams the decoder's layers take (altup_num_inputs)."""
    return int(inner.config.altup_num_inputs)


def fold(x: mx.array) -> mx.array:
    """(n, batch, tokens, hidden) -> (batch, tokens, n * hidden): the payload's shape."""
    n, b, length, d = x.shape
    return x.transpose(1, 2, 0, 3).reshape(b, length, n * d)


def unfold(h: mx.array, n: int) -> mx.array:
    """(batch, tokens, n * hidden) -> (n, batch, tokens, hidden), laid out as the model's
    own stack of streams is (contiguous), so the layers read the same memory layout."""
    b, length, width = h.shape
    return mx.contiguous(h.reshape(b, length, n, width // n).transpose(2, 0, 1, 3))


def first_stream(h: mx.array, n: int) -> mx.array:
    """Stream 0 of folded streams: the embedding `expand` started from, unchanged (the
    per-layer inputs are projected from it)."""
    return mx.contiguous(h[..., : h.shape[-1] // n])


def expand(inner: Any, h0: mx.array) -> mx.array:
    """The streams gemma3n's forward makes from the embedding before its first layer,
    folded."""
    target_magnitude = mx.mean(h0**2, axis=-1, keepdims=True) ** 0.5
    h_list = [h0]
    h_list.extend([proj(h0) for proj in inner.altup_projections])
    h = mx.stack(h_list, axis=0)
    mags = mx.mean(h[1:] ** 2, axis=-1, keepdims=True) ** 0.5
    h[1:] = h[1:] * (target_magnitude / mx.maximum(mags, mx.finfo(h0.dtype).min))
    return fold(h)


def merge(inner: Any, folded: mx.array) -> mx.array:
    """The one hidden state gemma3n's forward makes of the streams after its last layer,
    before the final norm (batch, tokens, hidden)."""
    h = unfold(folded, streams(inner))
    target_magnitude = mx.mean(h[0] ** 2, axis=-1, keepdims=True) ** 0.5
    for i, proj in enumerate(inner.altup_unembed_projections):
        h[i + 1] = proj(h[i + 1])
    mags = mx.mean(h[1:] ** 2, axis=-1, keepdims=True) ** 0.5
    # (the model takes the dtype of its embedding, which is the streams')
    h[1:] = h[1:] * (target_magnitude / mx.maximum(mags, mx.finfo(folded.dtype).min))
    return mx.mean(h, axis=0)
