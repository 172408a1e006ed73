"""Phi-3 small: muP multipliers on the embedding and logits, some token ids' logits set
to -inf, and decode groups row by row: its block-sparse attention layers place their
blocks by the length of the cache and add the boolean mask to their scores, so the
padded batch caches of a group (several sequences at once) would change its tokens."""

from mlx_relay.model.families.base import FamilyAdapter, Parts

ADAPTERS = (
    FamilyAdapter(
        names=("phi3small",),
        parts=Parts(norm="final_layernorm"),
        embed_op=lambda a, h: a.mup_embedding_multiplier * h if a.mup_embedding_multiplier else h,
        logits_op=lambda a, x: x / a.mup_width_multiplier if a.mup_width_multiplier else x,
        masked_ids="_dummy_tokenizer_ids",
        row_by_row=True,
    ),
)
