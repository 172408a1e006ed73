"""AFMoE: with muP, the embedding times sqrt(hidden)."""

import math

from mlx_relay.model.families.base import FamilyAdapter

ADAPTERS = (
    FamilyAdapter(
        names=("afmoe",),
        embed_op=lambda a, h: h * math.sqrt(a.hidden_size) if a.mup_enabled else h,
    ),
)
