"""LongCat Flash (n-gram): its embedding reads the sequence's ids before the step's,
keeping the last few in a cache of its own, first in the model's cache list: rank 0
keeps every sequence's ids (kvcache.SlotCaches) and gives each row its own to `embed`;
the layers' caches are the rest of the list."""

from mlx_relay.model.families.base import FamilyAdapter, Parts

ADAPTERS = (
    FamilyAdapter(
        names=("longcat_flash_ngram",), parts=Parts(embed="ngram_embeddings"), embed_reads_ids=True
    ),
)
