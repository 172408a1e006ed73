"""RecurrentGemma: a scaled embedding, soft-capped logits; its layers take
(x, cache, mask), and its forward gives every layer the local-attention mask, which the
recurrent layers ignore."""

import math

from mlx_relay.model.families.base import FamilyAdapter, Parts
from mlx_relay.model.families.ops import softcap

ADAPTERS = (
    FamilyAdapter(
        names=("recurrent_gemma",),
        parts=Parts(norm="final_norm"),
        embed_op=lambda a, h: h * math.sqrt(h.shape[-1]) if a.embeddings_scale_by_sqrt_dim else h,
        logits_op=lambda a, x: softcap(a.logits_soft_cap, x),
        layer_call=lambda layer, h, mask_for, c: layer(h, mask=mask_for(c), cache=c),
    ),
)
