"""Families that differ from a plain decoder only in what they name their parts."""

from mlx_relay.model.families.base import FamilyAdapter, Parts

_LFM2 = Parts(norm="embedding_norm")  # (its final norm, whatever the name says)
ADAPTERS = (
    FamilyAdapter(names=("phi",), parts=Parts(norm="final_layernorm"), kv_cache="attention"),
    FamilyAdapter(names=("jamba",), parts=Parts(norm="final_layernorm")),
    # (lfm2-vl: its lfm2 decoder in a language_model)
    FamilyAdapter(names=("lfm2", "lfm2_moe", "lfm2-vl"), parts=_LFM2),
    FamilyAdapter(
        names=("internlm2",),
        parts=Parts(embed="tok_embeddings", head="output"),
        kv_cache="attention",
    ),
    FamilyAdapter(
        names=("exaone",),
        parts=Parts(decoder="transformer", layers="h", embed="wte", norm="ln_f"),
        kv_cache="attention",
    ),
    FamilyAdapter(
        names=("gpt_neox",),
        parts=Parts(layers="h", embed="embed_in", norm="final_layer_norm", head="model.embed_out"),
    ),
    FamilyAdapter(names=("gptj",), parts=Parts(layers="h", embed="wte", norm="ln_f")),
    FamilyAdapter(
        names=("qwen",), parts=Parts(decoder="transformer", layers="h", embed="wte", norm="ln_f")
    ),
    FamilyAdapter(names=("spark2_5",), parts=Parts(embed="embedding")),
    FamilyAdapter(names=("openelm",), parts=Parts(decoder="transformer", embed="token_embeddings")),
    FamilyAdapter(
        names=("dbrx",),
        parts=Parts(decoder="transformer", layers="blocks", embed="wte", norm="norm_f"),
    ),
    FamilyAdapter(
        names=("lille-130m",), parts=Parts(decoder="transformer", embed="tok_embeddings")
    ),
    # its final norm is inside its head module (OutputHead: norm, then linear)
    FamilyAdapter(
        names=("phixtral",), parts=Parts(decoder="transformer", layers="h", embed="embd", norm=None)
    ),
)
