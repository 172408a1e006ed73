"""IQuest Loop Coder (mlx-lm's `iquestloopcoder`): every layer runs twice a step.

Its forward runs all its layers (the first pass, on full-attention caches), then all of
them again (the second pass): layer i's second call attends globally to the keys and
values its first call cached, and locally, within a window, to keys and values of its
own (a rotating cache), mixing the two by a learned gate per head. Split over ranks, a
step goes round the ring twice: the first lap runs each rank's layers once and brings
every position's hidden state back to rank 0, the second lap runs them again from there
(the step's header says which lap: protocol/header.py). Each layer's two caches travel
together as one CacheList (full, then rotating). The passes are the model's own code,
line for line, so a stage computes exactly what the whole model computes.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import CacheList, KVCache

FAMILY = "iquestloopcoder"


def pair_caches(caches: list[Any]) -> list[Any]:
    """The model's caches (every layer's full-attention cache, then every layer's
    rotating one) as one CacheList per layer."""
    n = len(caches) // 2
    return [CacheList(caches[i], caches[n + i]) for i in range(n)]


def first_pass(layers: list[Any], h: mx.array, caches: list[Any]) -> mx.array:
    """The first pass over these layers (as the model's first loop)."""
    if not layers:
        return h
    batch, length = h.shape[:2]
    mask = create_attention_mask(h, caches[0][0])
    for layer, pair in zip(layers, caches, strict=True):
        c = pair[0]
        h_norm = layer.input_layernorm(h)
        q1, k1, v1 = layer.self_attn.get_qkv(h_norm, c.offset)
        k1, v1 = c.update_and_fetch(k1, v1)
        out = layer.self_attn.attention(q1, k1, v1, mask, cache=c)
        r = layer.self_attn.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))
        h = h + r
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h


def second_pass(
    inner: Any, first: int, layers: list[Any], h: mx.array, caches: list[Any]
) -> mx.array:
    """The second pass over these layers (the model's from index `first` on), after the
    first pass of this step filled their full-attention caches."""
    from mlx_lm.models.iquestloopcoder import _mix_attention

    if not layers:
        return h
    batch, length = h.shape[:2]
    before = KVCache()  # (the masks are the model's, made before the step's first pass)
    before.offset = caches[0][1].offset
    mask = create_attention_mask(h, before)
    window_mask = create_attention_mask(h, caches[0][1], window_size=inner.loop_window_size)
    gates = inner.gate_projections[first : first + len(layers)]
    for layer, gate_proj, pair in zip(layers, gates, caches, strict=True):
        full, c = pair[0], pair[1]
        k1, v1 = full.keys_and_values()  # (what its first pass fetched this step)
        h_norm = layer.input_layernorm(h)
        q2, k2, v2 = layer.self_attn.get_qkv(h_norm, c.offset)
        gate = gate_proj(q2)
        attn_global = layer.self_attn.attention(q2, k1, v1, mask, cache=c)
        k2, v2 = c.update_and_fetch(k2, v2)
        attn_local = layer.self_attn.attention(q2, k2, v2, window_mask, cache=c)
        mixed = _mix_attention(gate, attn_global, attn_local)
        r = layer.self_attn.o_proj(mixed.transpose(0, 2, 1, 3).reshape(batch, length, -1))
        h = h + r
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h
