"""talkie: each block takes the normed embedding besides h (carried.py), weightless
norms on the embedding and as its final norm, and an LM head that is a bare
(vocab, hidden) parameter scaled by a learned gain."""

from mlx_relay.model import carried
from mlx_relay.model.families.base import FamilyAdapter, Parts
from mlx_relay.model.families.ops import weightless_norm

ADAPTERS = (
    FamilyAdapter(
        names=("talkie",),
        parts=Parts(layers="blocks", embed="embed", norm=None),
        embed_op=weightless_norm,
        pre_head_op=weightless_norm,
        head_call=lambda outer, h: outer.lm_head_gain(h @ outer.lm_head.T),
        carrier=carried.Talkie(),
    ),
)
