"""GPT-2 and StarCoder 1: GPT-style names, and learned position embeddings, which rank 0
adds at the embedding by each token's position and alone holds (`wpe`)."""

from mlx_relay.model.families.base import FamilyAdapter, Parts

_GPT2 = dict(position_embeddings="wpe", root_parts=("wpe",))
ADAPTERS = (
    FamilyAdapter(names=("gpt2",), parts=Parts(layers="h", embed="wte", norm="ln_f"), **_GPT2),
    FamilyAdapter(
        names=("gpt_bigcode",),
        parts=Parts(decoder="transformer", layers="h", embed="wte", norm="ln_f"),
        **_GPT2,
    ),
)
