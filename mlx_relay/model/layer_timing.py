"""What one of a model's layers takes for a decode step here: `--tensor-parallel auto`'s
measure of a token's work (coordinator/layout_choice.py).

A probe of raw weight reading (speed.py) says how fast memory is, not what a model's
layer costs: quantized matmuls, attention and each operation's launch come on top (on
two H200s a 4-bit Llama-3-70B token took four times its weights over the probed speed).
So the load times the model's own first layer, loaded alone, on a short context, the
way a decode step runs it: that is what a split divides and a pipeline does not.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import mlx.core as mx

from mlx_relay.device import compute_dtype
from mlx_relay.model import sharding

CONTEXT = 32  # positions already in the layer's cache when the steps are timed
STEPS = 8  # decode steps timed (after one warm-up); the median counts


def decode_step_seconds(path: Path) -> float:
    """Seconds one decode step of the model's first layer takes on this device."""
    shard = sharding.load_shard(path, 0, 1, has_ends=False)
    caches = shard.make_caches()
    width = sharding.hidden_size(shard.config)
    dtype = compute_dtype()
    mx.eval(sharding.run_layers(shard, mx.zeros((1, CONTEXT, width), dtype), caches))
    x = mx.zeros((1, 1, width), dtype)
    times = []
    for _ in range(STEPS + 1):
        start = time.perf_counter()
        mx.eval(sharding.run_layers(shard, x, caches))
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])
