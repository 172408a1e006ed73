"""Gemma and Gemma 2: the embedding times sqrt(hidden); Gemma 2 soft-caps its logits."""

from mlx_relay.model.families.base import FamilyAdapter
from mlx_relay.model.families.ops import scale_by_root, softcap

ADAPTERS = (
    FamilyAdapter(names=("gemma",), embed_op=scale_by_root, kv_cache="attention"),
    FamilyAdapter(
        names=("gemma2",),
        embed_op=scale_by_root,
        logits_op=lambda a, x: softcap(a.final_logit_softcapping, x),
        kv_cache="attention",
    ),
)
