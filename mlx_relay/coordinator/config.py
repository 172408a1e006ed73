"""Rank 0's serving configuration, frozen: built once from the command line
(launch/serve.py's `serve_config`) and passed down; nothing reads an option anywhere else.

`EngineConfig` is what the engine and the scheduler serve by; `memory` (a model-layer
`memory.Plan`) is what each load checks to fit and how it quantizes the KV caches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlx_relay.coordinator.speculation import SpecConfig
from mlx_relay.model.memory import Plan


@dataclass(frozen=True)
class EngineConfig:
    max_active: int = 8  # --max-active: sequences decoding at once (the slots)
    max_queue: int = 64  # --max-queue: requests waiting beyond that
    prefill_chunk: int = 512  # --prefill-chunk: the most prompt tokens per step
    default_max_tokens: int = 256  # --default-max-tokens: a request's when it has none
    prompt_cache: bool = True  # not --no-prompt-cache: finished caches kept for reuse
    prompt_cache_tokens: int = 0  # --prompt-cache-tokens (0: as many as the slots hold)
    prompt_cache_bytes: int = 0  # --prompt-cache-bytes: the same in bytes on each rank
    speculation: SpecConfig | None = None  # --draft ... (None: off)
    warm_up: str = "auto"  # --warm-up: run a first prompt's steps at load (warmup.py)
    # --max-active, --max-context, --kv-bits ...: what each load checks and quantizes
    # (max_active 0 there: the caches are not checked, as for a bare Pipeline in tests)
    memory: Plan = field(default_factory=Plan)
