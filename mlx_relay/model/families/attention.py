"""Plain decoders whose caches (plain KV, or sliding windows the config tells) memory.py
sizes from the config alone, though some make their own caches."""

from mlx_relay.model.families.base import FamilyAdapter

ADAPTERS = (
    FamilyAdapter(
        names=tuple(
            "llama mistral qwen2 qwen3 qwen2_moe qwen3_moe mixtral phi3 starcoder2 olmo olmo2 "
            "smollm3 glm4_moe".split()
        ),
        kv_cache="attention",
    ),
)
