"""AFM 7: its last layers sit in a second list (`kv_reuse_layers`,
`num_kv_reuse_layers` of them), run after the first, each reusing the keys and values
of the first list's last layer. A shard joins the two lists into one and splits that;
the reusing layers are KV-shared layers like Gemma 4's, so one rank holds them
together with the layer they reuse."""

import mlx.core as mx

from mlx_relay.model.families.base import FamilyAdapter, LayerRun, Parts


class Afm7(FamilyAdapter):
    def run_layers(self, run: LayerRun, h: mx.array) -> mx.array:
        """A reusing layer takes all that the reused layer's cache holds after this
        step's update, with that layer's mask."""
        for i, layer in enumerate(run.layers):
            source = run.kv_sources.get(i)
            if source is None:
                h = layer(h, run.mask_for(run.caches[i]), run.caches[i])
            else:
                keys, values = run.caches[source].keys_and_values()
                h = layer(h, keys, values, run.mask_for(run.caches[source]))
        return h


ADAPTERS = (
    Afm7(
        names=("afm7",),
        parts=Parts(embed="embedding", norm="output_norm"),
        reuse_list=("kv_reuse_layers", "num_kv_reuse_layers"),
    ),
)
