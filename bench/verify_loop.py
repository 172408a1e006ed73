"""A verify loop's cost without any engine, single process: steps of W positions at
growing offsets (keep 5, cut back the rest), each read back, against plain decode.

    .venv/bin/python bench/verify_loop.py MODEL_DIR [--padded]

`--padded` runs each multi-position step on keys padded to the cache's whole buffer
with a mask array instead of "causal": the same attention, but a key length that moves
only when the buffer grows (every 256 positions), so a backend that builds a kernel or
graph per key length (MLX's cuDNN attention on CUDA) builds one per 256 positions, not
one per step. Run with MLX_CUDA_USE_CUDNN_SDPA=0 to see MLX's unfused attention instead.
"""

import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

STEP = 256  # (mlx-lm's KVCache grows its buffer by this many positions)


class Padded:
    """A KVCache seen through keys padded to its buffer's length (see the docstring)."""

    def __init__(self, cache) -> None:
        self.cache = cache

    def __getattr__(self, name):
        return getattr(self.cache, name)

    def _size_after(self, n: int) -> int:
        c = self.cache
        grow = (STEP + n - 1) // STEP * STEP
        if c.keys is None:
            return grow
        size, prev = c.keys.shape[2], c.offset
        if prev + n <= size:
            return size
        return (prev if prev % STEP else size) + grow

    def make_mask(self, n: int, return_array: bool = False, window_size=None):
        if n == 1:
            return None
        positions = mx.arange(self.cache.offset, self.cache.offset + n)[:, None]
        return mx.arange(self._size_after(n))[None] <= positions

    def update_and_fetch(self, keys, values):
        self.cache.update_and_fetch(keys, values)
        if keys.shape[2] == 1:  # (one position: mlx-lm's own slice and no mask)
            return self.cache.keys_and_values()
        return self.cache.keys, self.cache.values


def run(model, width: int, keep: int, padded: bool, steps: int = 40) -> float:
    cache = make_prompt_cache(model)
    model(mx.array([list(range(100, 400))]), cache=cache)
    mx.eval([c.state for c in cache])
    view = [Padded(c) for c in cache] if padded else cache
    y = mx.array([[7] * width])
    t = 0.0
    for i in range(steps + 5):
        start = time.perf_counter()
        logits = model(y, cache=view)
        tokens = mx.argmax(logits[0], axis=-1).tolist()
        if width > keep:
            for c in cache:
                c.trim(width - keep)
        if i >= 5:
            t += time.perf_counter() - start
        y = mx.array([tokens[:1] * width])
    return t / steps * 1000


model, _ = load(sys.argv[1])
padded = "--padded" in sys.argv
# (twice each: the second pass meets the same offsets; if it is much faster, the first
# paid for kernels built per shape, not for the arithmetic)
for width, keep in ((1, 1), (5, 5), (5, 5), (8, 5), (8, 5)):
    print(
        f"width {width} keep {keep}{' padded' if padded else ''}: "
        f"{run(model, width, keep, padded):.2f} ms a step"
    )
