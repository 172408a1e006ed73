"""Llama 4: chunked attention on 3 of 4 layers (ChunkedKVCache, which has no batch
form: decode groups row by row); its text model names its head `output`."""

from mlx_relay.model.families.base import FamilyAdapter, Parts

ADAPTERS = (
    FamilyAdapter(names=("llama4",), row_by_row=True, chunked_attention=True),
    FamilyAdapter(names=("llama4_text",), parts=Parts(head="output")),
)
