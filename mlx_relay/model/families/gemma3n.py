"""Gemma 3n: per-layer inputs and KV-shared last layers as Gemma 4's, its hidden state
between layers AltUp streams (altup.py); its text decoder inside a multimodal model
whose towers mlx-lm drops on load."""

from typing import Any

import mlx.core as mx

from mlx_relay.model import altup, step_inputs
from mlx_relay.model.families.base import FamilyAdapter, LayerRun, Parts
from mlx_relay.model.families.gemma4 import PER_LAYER_PARTS
from mlx_relay.model.families.ops import own_softcap, scale_by_root


class Gemma3n(FamilyAdapter):
    def per_layer_inputs(
        self, inner: Any, vision: bool, tokens: mx.array, h: mx.array, ids_part: Any
    ) -> mx.array:
        """From stream 0, its embedding, as its forward computes them."""
        h0 = altup.first_stream(h, altup.streams(inner))
        return inner.project_per_layer_inputs(h0, inner.get_per_layer_inputs(tokens))

    def run_layers(self, run: LayerRun, h: mx.array) -> mx.array:
        """As its forward runs them, on its AltUp streams (folded in h: altup.py): every
        layer takes one position offset, the first cache's before the step, and a
        KV-shared layer the cache of the layer it reuses (updated earlier in this step),
        with that layer's mask."""
        x = altup.unfold(h, altup.streams(run.inner))
        offset = run.caches[0].offset if run.caches else 0
        for i, (layer, kw) in enumerate(zip(run.layers, run.kws, strict=True)):
            cache = run.caches[run.kv_sources.get(i, i)]
            x = layer(x, run.mask_for(cache), cache, offset=offset, **kw)
        return altup.fold(x)


ADAPTERS = (
    Gemma3n(
        names=("gemma3n",),
        parts=Parts(decoder="model.language_model"),  # (its towers: sanitize drops them)
        text_args="model.language_model.config",  # (its ModelArgs wrap a text config)
        embed_op=scale_by_root,  # (then its AltUp streams: altup.py)
        logits_op=own_softcap("gemma3n"),
        # and the projections that make and merge its AltUp streams
        root_parts=(*PER_LAYER_PARTS, "altup_projections", "altup_unembed_projections"),
        layer_inputs=step_inputs.per_layer,  # (always: every gemma3n has them)
        per_layer=True,
        kv_sharing="layer_idx_to_cache_idx",
        altup=True,
        sliding_pattern=True,
    ),
)
