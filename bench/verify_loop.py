"""A verify loop's cost without any engine, single process: steps of W positions at
growing offsets (keep 5, cut back the rest), each read back, against plain decode.

    .venv/bin/python bench/verify_loop.py MODEL_DIR
"""

import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache


def run(model, width: int, keep: int, steps: int = 40) -> float:
    cache = make_prompt_cache(model)
    model(mx.array([list(range(100, 400))]), cache=cache)
    mx.eval([c.state for c in cache])
    y = mx.array([[7] * width])
    t = 0.0
    for i in range(steps + 5):
        start = time.perf_counter()
        logits = model(y, cache=cache)
        tokens = mx.argmax(logits[0], axis=-1).tolist()
        if width > keep:
            for c in cache:
                c.trim(width - keep)
        if i >= 5:
            t += time.perf_counter() - start
        y = mx.array([tokens[:1] * width])
    return t / steps * 1000


model, _ = load(sys.argv[1])
# (twice each: the second pass meets the same offsets; if it is much faster, the first
# paid for kernels built per shape, not for the arithmetic)
for width, keep in ((1, 1), (5, 5), (5, 5), (8, 5), (8, 5)):
    print(f"width {width} keep {keep}: {run(model, width, keep):.2f} ms a step")
