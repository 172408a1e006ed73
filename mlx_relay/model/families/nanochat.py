"""nanochat: GPT-style names (`transformer.h`, `wte`), weightless norms (its own
functional rms_norm, on the embedding and as its final norm: it has no norm module),
and its own compiled soft cap of the logits (cap 15, the function's default)."""

from typing import Any

import mlx.core as mx

from mlx_relay.model.families.base import FamilyAdapter, Parts


def _norm(a: Any, h: mx.array) -> mx.array:
    from mlx_lm.models.nanochat import rms_norm

    return rms_norm(h)


def _softcap(a: Any, x: mx.array) -> mx.array:
    from mlx_lm.models.nanochat import softcap

    return softcap(x)


ADAPTERS = (
    FamilyAdapter(
        names=("nanochat",),
        parts=Parts(decoder="transformer", layers="h", embed="wte", norm=None),
        embed_op=_norm,
        pre_head_op=_norm,
        logits_op=_softcap,
    ),
)
