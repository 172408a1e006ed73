"""How fast this rank reads weights: the probe the default split weighs ranks by.

People's Macs differ (an M2 Ultra beside an M4 Pro reads memory about three times as
fast), and decoding a token is reading every weight once, so a rank's share of the
layers should follow its memory bandwidth, not only its memory size. Before the default
split is made, every rank runs `probe()` in turn (rank 0 sends CMD_PROBE round the ring,
so no two ranks of one machine measure at once) and rank 0 splits by the results.

The probe is a matrix-vector product over a weight matrix larger than a processor's
caches, in the dtype of the device's own models (bfloat16 on a GPU, float32 on a CPU,
where MLX's bfloat16 is slow), timed in a few short runs of which the best counts: a
run slowed by something else on the machine (another process, a test runner) should not
count against the rank, while a rank that is slow all the time (a throttled core, a
smaller chip) is slow in every run.
"""

from __future__ import annotations

import time

import mlx.core as mx

from mlx_relay.device import compute_dtype, on_gpu

# The matrix read each pass: beyond caches (an M2 Ultra's system-level cache is 96 MB);
# smaller on a CPU (test clusters), where a pass over 256 MB would take a second.
GPU_PROBE_BYTES = 256 * 2**20
CPU_PROBE_BYTES = 8 * 2**20
RUNS = 3  # the best of these counts
RUN_S = 0.04  # each run reads the matrix for about this long
# Ranks within this factor of each other count as equally fast: what a busy machine's
# noise can make of equal ranks stays under it, Macs of different classes are above it
# (memory bandwidth: an M4 Max's 546 GB/s against an M4 Pro's 273, an M2 Ultra's 800).
SAME_SPEED = 1.6


def probe(runs: int = RUNS, run_s: float = RUN_S) -> float:
    """This rank's weight-reading speed in MB/s (the best of `runs` timed runs)."""
    gpu = on_gpu()
    dtype = compute_dtype()
    cols = 4096
    rows = (GPU_PROBE_BYTES if gpu else CPU_PROBE_BYTES) // (cols * dtype.size)
    weights = mx.full((rows, cols), 0.5, dtype=dtype)
    x = mx.ones((cols,), dtype=dtype)
    mx.eval(weights, x)
    passes = _passes_within(weights, x, run_s)
    best = 0.0
    for _ in range(runs):
        seconds = _timed(weights, x, passes)
        best = max(best, passes * weights.nbytes / max(seconds, 1e-9) / 1e6)
    return best


def _timed(weights: mx.array, x: mx.array, passes: int) -> float:
    """Seconds for `passes` products, each reading all of `weights` (the results are
    summed so that none is left out of the graph)."""
    start = time.perf_counter()
    total = mx.zeros((weights.shape[0],), dtype=weights.dtype)
    for i in range(passes):
        total = total + weights @ (x * (i + 1))
    mx.eval(total)
    return time.perf_counter() - start


def _passes_within(weights: mx.array, x: mx.array, run_s: float) -> int:
    """How many passes take about `run_s` (a first pass warms up, then one is timed)."""
    _timed(weights, x, 1)
    once = _timed(weights, x, 2) / 2
    return max(2, min(4096, round(run_s / max(once, 1e-7))))


def speed_weights(speeds: list[float]) -> list[float] | None:
    """Per-rank weights for the split, or None where the ranks are equally fast (within
    SAME_SPEED of each other) or a figure is missing: the plain balanced split."""
    if not speeds or any(s <= 0 for s in speeds):
        return None
    if max(speeds) <= SAME_SPEED * min(speeds):
        return None
    return [float(s) for s in speeds]
