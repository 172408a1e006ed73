"""AFM 7: its last layers sit in a second list (`kv_reuse_layers`,
`num_kv_reuse_layers` of them), run after the first, each reusing the keys and values
of the first list's last layer. A shard joins the two lists into one and splits that;
the reusing layers are KV-shared layers like Gemma 4's, so one rank holds them
together with the layer they reuse."""

from mlx_relay.model.families.base import FamilyAdapter, Parts

ADAPTERS = (
    FamilyAdapter(
        names=("afm7",),
        parts=Parts(embed="embedding", norm="output_norm"),
        reuse_list=("kv_reuse_layers", "num_kv_reuse_layers"),
    ),
)
