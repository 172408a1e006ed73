"""Cohere (Command R) and Cohere 2: the logits times `logit_scale`."""

from dataclasses import replace

from mlx_relay.model.families.base import FamilyAdapter

_COHERE = FamilyAdapter(
    names=("cohere",), logits_op=lambda a, x: x * a.logit_scale, kv_cache="attention"
)
ADAPTERS = (_COHERE, replace(_COHERE, names=("cohere2",), kv_cache=None))
