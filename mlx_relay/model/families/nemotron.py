"""Nemotron-H and Nemotron-NAS: some layers keep no cache (Nemotron-H's MLP and MoE
blocks between its mamba and attention ones; NAS's no-op attention): the model makes
caches for the others only, and a layer without one gets neither cache nor mask, as the
family's forward gives it nothing it reads."""

from mlx_relay.model.families.base import FamilyAdapter, Parts

ADAPTERS = (
    FamilyAdapter(
        names=("nemotron_h",),
        parts=Parts(decoder="backbone", embed="embeddings", norm="norm_f"),
        keeps_cache=lambda layer: layer.block_type in ("M", "*"),
    ),
    FamilyAdapter(names=("nemotron-nas",), keeps_cache=lambda layer: layer.self_attn is not None),
)
