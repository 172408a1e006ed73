"""MiniCPM: the embedding times `scale_emb`; the normed state scaled down before an
untied head only."""

from typing import Any

import mlx.core as mx

from mlx_relay.model.families.base import FamilyAdapter


def _pre_head(a: Any, h: mx.array) -> mx.array:
    return h if a.tie_word_embeddings else h / (a.hidden_size / a.dim_model_base)


ADAPTERS = (
    FamilyAdapter(
        names=("minicpm", "minicpm3"),
        embed_op=lambda a, h: h * a.scale_emb,
        pre_head_op=_pre_head,
    ),
)
