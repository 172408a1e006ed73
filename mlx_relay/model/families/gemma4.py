"""Gemma 4's text decoder (mlx-lm's gemma4_text; a gemma4 checkpoint wraps it).

Its 2B/4B layouts' layers each take a per-layer input, which rank 0 computes every step
from the token ids through a per-layer embedding table as large as most of the model
(only rank 0 holds it: `root_parts`); their last layers reuse earlier layers' keys and
values, computed in the same step (`kv_sharing`: one rank holds both). Its layers
return (h, keys and values, offset), which a KV-shared layer takes. As a
vision-language model (mlx-vlm's gemma4) its layers also take an image prompt's token
types, for its image mask (vision.py).
"""

from typing import Any

import mlx.core as mx

from mlx_relay.model import step_inputs
from mlx_relay.model.families.base import FamilyAdapter, LayerRun
from mlx_relay.model.families.ops import own_softcap, scale_by_root

# rank 0's: the per-layer embedding table and its projection
PER_LAYER_PARTS = (
    "embed_tokens_per_layer",
    "per_layer_model_projection",
    "per_layer_projection_norm",
)


class Gemma4(FamilyAdapter):
    def per_layer_inputs(
        self, inner: Any, vision: bool, tokens: mx.array, h: mx.array, ids_part: Any
    ) -> mx.array:
        """As its forward computes them before the first layer, by the model's own
        methods; `ids_part`: the part from the ids, already computed (an image prompt's,
        by mlx-vlm's get_input_embeddings)."""
        if vision:  # (mlx-vlm's gemma4 names them without mlx-lm's underscore)
            if ids_part is None:
                ids_part = inner.get_per_layer_inputs(tokens)
            return inner.project_per_layer_inputs(h, ids_part)
        return inner._project_per_layer_inputs(h, inner._get_per_layer_inputs(tokens))

    def run_layers(self, run: LayerRun, h: mx.array) -> mx.array:
        """As its forward runs them: a layer with its own cache returns its keys, values
        and offset, and a KV-shared layer (no cache) takes those of the layer it reuses,
        from this very step, with that layer's mask."""
        returned: dict[int, tuple[Any, Any]] = {}
        for i, (layer, kw) in enumerate(zip(run.layers, run.kws, strict=True)):
            source = run.kv_sources.get(i)
            if source is None:
                h, kvs, offset = layer(h, run.mask_for(run.caches[i]), run.caches[i], **kw)
                returned[i] = (kvs, offset)
            else:
                kvs, offset = returned[source]
                mask = run.mask_for(run.caches[source])
                h = layer(h, mask, None, shared_kv=kvs, offset=offset, **kw)[0]
        return h


def _takes_inputs(a: Any) -> bool:
    """Per-layer inputs in the 2B/4B layouts only; token types as a VLM."""
    return (
        bool(getattr(a, "hidden_size_per_layer_input", 0))
        or getattr(a, "use_bidirectional_attention", None) == "vision"
    )


ADAPTERS = (
    Gemma4(
        names=("gemma4_text",),
        wrappers=("gemma4",),
        embed_op=scale_by_root,
        logits_op=own_softcap("gemma4_text"),
        root_parts=PER_LAYER_PARTS,
        # returns (h, its keys and values, offset), which a KV-shared layer takes
        # (run_layers passes them where a layer reuses an earlier one's)
        layer_call=lambda layer, h, mask_for, c, **kw: layer(h, mask_for(c), c, **kw)[0],
        layer_inputs=step_inputs.per_layer,
        inputs_when=_takes_inputs,
        per_layer=True,
        kv_sharing="previous_kvs",
        prefills_images_whole=True,
    ),
)
