"""Splitting every layer of a model across a tensor group, the way mlx-lm does it.

mlx-lm gives 24 families a `shard(group)` method: each attention and MLP projection
becomes one of MLX's sharded linear layers, each rank keeping 1/T of its rows or
columns, with an all-sum of the group after the attention's output projection and
after the MLP's down projection. mlx-relay uses exactly that method, so a tensor
group's tokens are mlx-lm's own distributed generation's with the same group. A family
without it (or whose heads do not divide by T, or that mlx-relay runs its own way)
runs as a pipeline, and `refusal` says why.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_relay.model import vision
from mlx_relay.model.families import adapter_of, mlx_lm_model_class


def refusal(config: dict[str, Any], tensor: int) -> str | None:
    """Why the model of `config` cannot split its layers across `tensor` ranks (None:
    it can), in words for the load's log and `status`."""
    family = config.get("model_type", "?")
    if vision.is_vlm(config):
        return f"{family} is a vision model: its layers run as a pipeline"
    if adapter_of(config).passes == 2:
        return f"{family} runs each step's layers twice: it runs as a pipeline"
    model_class = mlx_lm_model_class(family)
    if model_class is None or not callable(getattr(model_class, "shard", None)):
        return f"mlx-lm's {family} has no shard(): its layers cannot be split"
    text = config.get("text_config") or config
    for key in ("num_attention_heads", "num_key_value_heads"):
        value = text.get(key)
        if isinstance(value, int) and value % tensor:
            return f"{family}'s {key} ({value}) does not divide by {tensor}"
    return None


def split(model: nn.Module, config: dict[str, Any], group: mx.distributed.Group) -> None:
    """Give this rank its slice of every layer the model still holds (lazily: the
    slices are what the load then evaluates, so no rank reads more than its part)."""
    why = refusal(config, group.size())
    if why is not None:
        raise ValueError(why)
    model.shard(group)
    for _, module in model.named_modules():
        if isinstance(module, _GRADIENT_HOOKED):
            module.group = _NO_GRADIENT_SUM


class _GroupOfOne:
    """What the split projections get as `group` in place of the tensor group, the one
    thing they use it for being their training hook: an AllToSharded layer passes its
    input through `sum_gradients(group)`, an identity in the forward pass (its gradient
    is the all-sum), built as an mx.custom_function that Python calls on every
    projection; for a group of one size it is a plain `lambda x: x`. The forward math
    is MLX's own either way, so the tokens stay those of mlx-lm's split generation. On
    the tiny llama split over 2 ranks on this CPU, building a decode step's graph took
    3.2 ms with the hook and 2.6 without: 14 us a projection (bench/RESULTS.md)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


_NO_GRADIENT_SUM = _GroupOfOne()
_GRADIENT_HOOKED = (nn.AllToShardedLinear, nn.QuantizedAllToShardedLinear)
