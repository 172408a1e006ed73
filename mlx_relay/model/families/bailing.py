"""Bailing (Ling) models: the embedding named `word_embeddings`; the linear-attention
ones' layers each take the step's first position, which their forward reads from an
attention layer's cache (a rank may hold none): from the step's header here."""

from dataclasses import replace

from mlx_relay.model import step_inputs
from mlx_relay.model.families.base import FamilyAdapter, Parts
from mlx_relay.model.families.ops import keyword_call

_BAILING = FamilyAdapter(
    names=("bailing_moe", "bailing_moe_v3"), parts=Parts(embed="word_embeddings")
)
ADAPTERS = (
    _BAILING,
    replace(
        _BAILING,
        names=("bailing_moe_linear", "bailing_hybrid"),
        layer_call=keyword_call,
        layer_inputs=step_inputs.step_offset,
    ),
)
