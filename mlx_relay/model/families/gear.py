"""Gear: the embedding times sqrt(hidden), soft-capped logits."""

import math

from mlx_relay.model.families.base import FamilyAdapter
from mlx_relay.model.families.ops import softcap

ADAPTERS = (
    FamilyAdapter(
        names=("gear",),
        embed_op=lambda a, h: h * math.sqrt(a.hidden_size),
        logits_op=lambda a, x: softcap(a.final_logit_softcapping, x),
    ),
)
