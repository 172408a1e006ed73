"""RWKV-7: each layer takes and returns the first layer's values besides h (carried.py)."""

from mlx_relay.model import carried
from mlx_relay.model.families.base import FamilyAdapter, Parts

ADAPTERS = (
    FamilyAdapter(names=("rwkv7",), parts=Parts(embed="embeddings"), carrier=carried.Rwkv7()),
)
