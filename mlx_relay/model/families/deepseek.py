"""DeepSeek: V3 (and Kimi K2, which loads as it) and V3.2 keep MLA caches whose size
the config gives (V3.2 with an indexer key per position, in a CacheList); V4.1 carries
hyper-connection streams (deepseek_v4.py), its layers take no mask, and its caches
have no batch form (decode groups row by row)."""

from mlx_relay.model import carried, deepseek_v4
from mlx_relay.model.families.base import FamilyAdapter

ADAPTERS = (
    FamilyAdapter(names=("deepseek_v3", "kimi_k2"), kv_cache="mla"),
    FamilyAdapter(names=("deepseek_v32",), kv_cache="mla_indexer"),
    FamilyAdapter(
        names=(deepseek_v4.FAMILY,),
        carrier=carried.DeepSeekV4(),
        row_by_row=True,
        maskless=True,
    ),
)
