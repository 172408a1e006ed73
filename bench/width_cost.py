"""What one forward step of N positions costs a model, N = 1..16, single process.

    .venv/bin/python bench/width_cost.py MODEL_DIR

A verify step carries 1 + k positions; where the step's cost hardly grows with N (the
weights are read once either way) every proposal pays, where it grows steeply (a CPU's
compute, a kernel that dequantizes whole weights for N > 1) few or none do.
"""

import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

model, _ = load(sys.argv[1])
cache = make_prompt_cache(model)
model(mx.array([list(range(100, 400))]), cache=cache)
mx.eval([c.state for c in cache])
print("positions  ms (median of 20)  ratio to 1")
base = None
for n in (1, 2, 3, 4, 5, 6, 8, 12, 16):
    times = []
    for _ in range(23):
        t = time.perf_counter()
        mx.eval(model(mx.array([[7] * n]), cache=cache))
        times.append(time.perf_counter() - t)
        for c in cache:
            c.trim(n)
    ms = sorted(times[3:])[10] * 1000
    base = base or ms
    print(f"{n:9d}  {ms:16.2f}  {ms / base:10.2f}")
