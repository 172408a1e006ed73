"""What the loaded model means to the coordinator, made once at load: its tokenizer, its
chat markup, its output rules, its context, rank 0's shard and the memory check.

The engine makes it when a load succeeds and hands it to the scheduler and the doors
(through the engine's `model`); nothing of it changes until the next load or free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mlx_lm.utils import load_tokenizer

from mlx_relay.coordinator.admission import MemoryCheck
from mlx_relay.coordinator.output import OutputProcessor
from mlx_relay.coordinator.prefix_index import PrefixIndex
from mlx_relay.model import vision
from mlx_relay.model.sharding import Shard
from mlx_relay.text.markup import ChatMarkup


@dataclass(frozen=True)
class ModelContext:
    tokenizer: Any
    markup: ChatMarkup  # its chat markup, resolved once
    output: OutputProcessor  # the output rules (EOS, stop strings, the context's end)
    shard: Shard  # rank 0's: its config and what its caches allow
    hidden: int  # the model's hidden size (what context costs: pace.py)
    memory: MemoryCheck | None = None  # whether a new sequence's caches fit now
    # an image prompt goes in one step (vision.prefills_whole: gemma4's image mask)
    whole_images: bool = False
    # --prompt-cache-dir: the blocks every rank keeps on disk (None: none for this model)
    prefixes: PrefixIndex | None = None

    @classmethod
    def of(
        cls, tokenizer: Any, shard: Shard, hidden: int, memory: MemoryCheck | None = None
    ) -> ModelContext:
        context_length = int(shard.config.get("max_position_embeddings") or 0)
        return cls(
            tokenizer,
            ChatMarkup.of(tokenizer),
            OutputProcessor(tokenizer, context_length),
            shard,
            hidden,
            memory,
            vision.prefills_whole(shard.config),
        )

    @classmethod
    def at_load(cls, pipeline: Any, loaded: Any, max_context: int) -> ModelContext:
        """The context of the model `pipeline` just loaded (`loaded`: its LoadedModel),
        with the memory check for its sequences (`max_context`: --max-context)."""
        model = cls.of(load_tokenizer(loaded.path), pipeline.shard, pipeline.hidden_size)
        check = MemoryCheck(loaded, model.context_length, max_context, pipeline.hub)
        return dataclasses.replace(model, memory=check, prefixes=pipeline.prefix_index())

    @property
    def context_length(self) -> int:
        """The model's context (0: none known)."""
        return self.output.context_length

    @property
    def config(self) -> dict[str, Any]:
        return self.shard.config

    @property
    def reusable(self) -> bool:
        """Its caches can be cut back to a shared prefix (the prompt cache may keep them)."""
        return self.shard.reusable_caches
