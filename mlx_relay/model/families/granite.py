"""Granite (and its MoE and mamba-hybrid kin): the embedding times
`embedding_multiplier`, the logits over `logits_scaling`."""

from dataclasses import replace

from mlx_relay.model.families.base import FamilyAdapter

_GRANITE = FamilyAdapter(
    names=("granite",),
    embed_op=lambda a, h: h * a.embedding_multiplier,
    logits_op=lambda a, x: x / a.logits_scaling,
    kv_cache="attention",
)
ADAPTERS = (
    _GRANITE,
    replace(_GRANITE, names=("granitemoe", "granitemoehybrid"), kv_cache=None),
)
