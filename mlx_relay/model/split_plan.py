"""Which layers each rank loads: the plan rank 0 makes before a load, from what it knows.

split.py says what `--layers` means; this module decides the counts a load uses, given
what the running ranks report: their memory figures (rank 0's own and each worker's
last heartbeat's) and, where the ranks run on different machines, their measured
weight-reading speeds (speed.py; rank 0 measures them round the ring, one rank after
another). Nothing here talks to a rank: the caller passes the figures in (the speeds
as a callable, since measuring them takes a step round the ring and only the default
split needs them), so the plan is a function of its inputs and tested as one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlx_relay.model import memory, sharding
from mlx_relay.model.speed import speed_weights
from mlx_relay.model.split import (
    AUTO,
    default_split,
    keep_kv_shared_together,
    layer_costs,
    layer_ranges,
    memory_split,
)

log = logging.getLogger("mlx_relay.split")

Stats = list[dict[str, Any] | None]  # each rank's memory figures (None: not reported yet)


def plan_ranges(
    path: Path,
    world_size: int,
    layers: list[int] | str | None,
    *,
    stats: Callable[[], Stats],
    speeds: Callable[[], list[float] | None],
) -> list[tuple[int, int]]:
    """Each rank's layer range [start, end) for the model at `path`: `layers` as given
    (counts), or computed (AUTO: by memory; None: by speed where the ranks differ,
    else equal work), checked to cover the model with a layer a rank at least, and
    moved so that a KV-shared tail stays on one rank."""
    num_layers = sharding.count_layers(sharding.read_config(path))
    counts, computed = plan_counts(path, num_layers, world_size, layers, stats, speeds)
    if len(counts) != world_size or sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(
            f"layer split {counts} does not cover {num_layers} layers over "
            f"{world_size} ranks with at least one layer each"
        )
    return layer_ranges(keep_kv_shared_together(path, list(counts), computed))


def plan_counts(
    path: Path,
    num_layers: int,
    world_size: int,
    layers: list[int] | str | None,
    stats: Callable[[], Stats],
    speeds: Callable[[], list[float] | None],
) -> tuple[list[int], bool]:
    """The layer counts to load, and whether they were computed here (by memory or
    by speed; named splits arrive as counts that keep a KV-shared tail already).

    The default: equal work per rank, rank 0's LM head counted (the fastest split
    under load in bench_concurrency; single-stream speed does not depend on it),
    where the ranks are equally fast; else work in proportion to each rank's
    measured speed, unless that would not fit a rank's memory, when the split by
    memory (`auto`) is taken instead."""
    if layers and layers != AUTO:
        return list(layers), False
    config = sharding.read_config(path)
    costs = layer_costs(path, num_layers, config)
    figures = stats()
    if layers == AUTO:
        return memory_split(num_layers, figures, costs), True
    weights = speed_weights(speeds())
    counts = default_split(path, num_layers, world_size, weights)
    if weights is None:
        return counts, False
    rooms = [None if f is None else memory.headroom(f) for f in figures]
    short = memory.short_rank(path, layer_ranges(counts), rooms)
    if short is not None:
        log.info("layers by speed %s do not fit rank %d's memory: by memory", counts, short)
        return memory_split(num_layers, figures, costs), True
    log.info("layers by speed: %s MB/s per rank -> layers %s", weights, counts)
    return counts, True


def host_speeds(measured: list[float], hosts: list[str]) -> list[float] | None:
    """Each rank's speed for the split, from what each measured (`measured`) on its host
    (`hosts`): ranks of one machine are equally fast, each counts as the fastest of
    them, so what else runs there does not tell them apart. None where all ranks share
    one machine (then nothing needs measuring: see `probes_speed`)."""
    if not probes_speed(hosts):
        return None
    best = {h: max(m for m, o in zip(measured, hosts, strict=True) if o == h) for h in hosts}
    return [best[h] for h in hosts]


def probes_speed(hosts: list[str], max_ranks: int | None = None) -> bool:
    """Whether ranks on `hosts` (one a rank) are worth measuring: on two machines or
    more, and (`max_ranks`, what a probe step's header has room for) not too many."""
    return len(set(hosts)) >= 2 and (max_ranks is None or len(hosts) <= max_ranks)
