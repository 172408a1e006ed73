"""What rank 0 can check about a model before the serving one is let go.

Loading a model replaces the one being served: the engine ends its requests and every
rank releases its shard before loading the new one (two models rarely fit at once).
So everything that can be found wrong from rank 0 alone is checked here first, while
the old model still serves: the path resolves to a model directory, its config is
readable and names a layer count and a supported architecture, its weights and
tokenizer are there, the layer split covers it, and rank 0's share of the weights fits
in what this machine has (counting the memory the old shard gives back). A load
refused here leaves the cluster exactly as it was. What only a worker can find (its
own memory, its copy of the files) still fails after the old model was released;
`api.cluster.Cluster.load` then loads the old one again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from mlx_relay.coordinator.requests import InvalidRequest
from mlx_relay.model import checkpoint, memory, sharding, tensor_split, vision
from mlx_relay.model.default_model import ModelError, resolve_model
from mlx_relay.model.split import AUTO, Layers, default_split

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


class DoesNotFit(RuntimeError):
    """Rank 0's share of the new model's weights is more than this machine can hold."""


@dataclass(frozen=True)
class LoadPlan:
    """What the checks found: the model's directory and its layer count."""

    path: Path
    num_layers: int


def check_loadable(
    spec: str,
    layers: Layers,
    world_size: int,
    serving: tuple[str, int, int] | None = None,
    *,
    stages: int | None = None,
) -> LoadPlan:
    """Raise InvalidRequest (the model is not one we can load) or DoesNotFit (rank 0's
    share is too big) for `spec` split as `layers` over `world_size` ranks; return what
    was found. `serving`: the loaded model's (path, start, end) on rank 0, whose memory
    the load frees before it loads anything. `stages`: the pipeline stages that each need
    a layer range (a stage x tensor grid's, fewer than its ranks; the start's rule,
    transport/tensor.py's stage_count), else one a rank."""
    stages = stages or world_size
    try:
        path = resolve_model(spec, progress=False)
    except ModelError as e:
        raise InvalidRequest(str(e)) from e
    try:
        config = sharding.read_config(path)
    except (OSError, ValueError) as e:
        raise InvalidRequest(f"model {spec!r}: {path}/config.json is not readable JSON: {e}") from e
    if not isinstance(config, dict):
        raise InvalidRequest(f"model {spec!r}: {path}/config.json is not a JSON object")
    try:
        num_layers = sharding.count_layers(config)
    except (TypeError, ValueError) as e:
        raise InvalidRequest(f"model {spec!r}: {e}") from e
    if stages < world_size and tensor_split.refusal(config, world_size // stages) is not None:
        stages = world_size  # (a family whose layers cannot split runs as a pipeline)
    if num_layers < stages:
        holders = f"{world_size} ranks" if stages == world_size else f"{stages} pipeline stages"
        raise InvalidRequest(
            f"model {spec!r} has {num_layers} layers, fewer than the {holders} "
            "that must each hold at least one"
        )
    _check_architecture(spec, config)
    if not any(path.glob("*.safetensors")):
        raise InvalidRequest(f"model {spec!r}: {path} holds no *.safetensors weights")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise InvalidRequest(
            f"model {spec!r}: {path} holds no tokenizer ({', '.join(TOKENIZER_FILES)})"
        )
    try:
        sharding.fingerprint(path)
        checkpoint.tensor_bytes(path)
    except (OSError, ValueError) as e:
        raise InvalidRequest(f"model {spec!r}: its weights are not readable: {e}") from e
    counts = layers if isinstance(layers, list) else None
    if counts is not None and (sum(counts) != num_layers or len(counts) != world_size):
        raise InvalidRequest(
            f"layers: the split {counts} does not cover the {num_layers} layers of "
            f"{spec!r} over {world_size} ranks"
        )
    if layers != AUTO:  # (an auto split is made from what every rank reports)
        first = (counts or default_split(path, num_layers, stages))[0]
        _check_rank0_fits(path, first, serving)
    return LoadPlan(path, num_layers)


def _check_architecture(spec: str, config: dict[str, Any]) -> None:
    """mlx-lm (or mlx-vlm, for a vision-language model) must know the model type."""
    if vision.is_vlm(config):
        return
    from mlx_lm.utils import _get_classes  # (mlx-lm's own lookup, remappings included)

    if "model_type" not in config:
        raise InvalidRequest(f"model {spec!r}: config.json has no model_type")
    try:
        _get_classes(config)
    except (ValueError, ImportError) as e:
        raise InvalidRequest(f"model {spec!r}: {e}") from e


def _check_rank0_fits(path: Path, end: int, serving: tuple[str, int, int] | None) -> None:
    """Rank 0's weights (layers [0, end), the embedding and the head) against what it
    may use once the serving shard is gone; the caches are checked once loaded."""
    need = memory.shard_nbytes(path, 0, end, ends=True)
    freed = (
        memory.shard_nbytes(Path(serving[0]), serving[1], serving[2], ends=True) if serving else 0
    )
    allowed, why = psutil.virtual_memory().available + freed, "memory available"
    limit = memory.memory_limit()
    if limit is not None and limit < allowed:
        allowed, why = limit, f"{memory.MEMORY_LIMIT_ENV}={os.environ[memory.MEMORY_LIMIT_ENV]}"
    if need > allowed:
        raise DoesNotFit(
            f"rank 0 ({os.uname().nodename}): layers [0, {end}) with embedding and head need "
            f"{need / 2**20:,.1f} MiB of weights, but this rank may use "
            f"{allowed / 2**20:,.1f} MiB ({why}, the serving model's shard counted as "
            "freed); use more ranks, another split or a smaller model"
        )
