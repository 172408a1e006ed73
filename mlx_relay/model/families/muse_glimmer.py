"""Muse Glimmer: a weightless norm on the embedding; the logits times
`output_multiplier`, then soft-capped."""

from mlx_relay.model.families.base import FamilyAdapter
from mlx_relay.model.families.ops import softcap, weightless_norm

ADAPTERS = (
    FamilyAdapter(
        names=("muse_glimmer",),
        embed_op=weightless_norm,
        logits_op=lambda a, x: softcap(a.final_logit_softcapping, x * a.output_multiplier),
    ),
)
