"""AFM 7: its last layers sit in a second list (`kv_reuse_layers`,
`num_kv_reuse_layers` of them), run after the first, each reusing the keys and values
of the first list's last layer. A shard joins the two lists into one and splits that;
the reusing layers are KV-shared layers like Gemma 4's, so one rank holds them
together with the layer they reuse."""

from typing import Any

import mlx.core as mx

from mlx_relay.model.carried import MaskFor
from mlx_relay.model.families.base import FamilyAdapter, Parts


class Afm7(FamilyAdapter):
    def run_layers(
        self,
        inner: Any,
        layers: list[Any],
        kv_sources: dict[int, int],
        h: mx.array,
        caches: list[Any],
        kws: list[dict[str, Any]],
        mask_for: MaskFor,
    ) -> mx.array:
        """A reusing layer takes all that the reused layer's cache holds after this
        step's update, with that layer's mask."""
        for i, layer in enumerate(layers):
            source = kv_sources.get(i)
            if source is None:
                h = layer(h, mask_for(caches[i]), caches[i])
            else:
                keys, values = caches[source].keys_and_values()
                h = layer(h, keys, values, mask_for(caches[source]))
        return h


ADAPTERS = (
    Afm7(
        names=("afm7",),
        parts=Parts(embed="embedding", norm="output_norm"),
        reuse_list=("kv_reuse_layers", "num_kv_reuse_layers"),
    ),
)
