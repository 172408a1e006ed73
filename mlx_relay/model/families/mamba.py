"""Mamba and Mamba 2: the decoder named `backbone`; Mamba's layers take no mask, its
mixers reading only their conv and SSM state."""

from mlx_relay.model.families.base import FamilyAdapter, Parts

_BACKBONE = Parts(decoder="backbone", embed="embeddings", norm="norm_f")
ADAPTERS = (
    FamilyAdapter(
        names=("mamba",), parts=_BACKBONE, layer_call=lambda layer, h, mask_for, c: layer(h, c)
    ),
    FamilyAdapter(names=("mamba2",), parts=_BACKBONE),
)
