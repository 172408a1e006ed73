"""Falcon-H1: a mamba mixer and attention side by side in each layer, each given its
own cache's mask; its multipliers folded into the weights, except a tied head's."""

from typing import Any

import mlx.core as mx

from mlx_relay.model.families.base import FamilyAdapter, Parts


def _logits(a: Any, x: mx.array) -> mx.array:
    return x * (a.lm_head_multiplier / a.embedding_multiplier) if a.tie_word_embeddings else x


ADAPTERS = (
    FamilyAdapter(
        names=("falcon_h1",),
        parts=Parts(norm="final_layernorm"),
        logits_op=_logits,
        layer_call=lambda layer, h, mask_for, c: layer(
            h, cache=c, attn_mask=mask_for(c[1]), mamba_mask=mask_for(c[0])
        ),
    ),
)
