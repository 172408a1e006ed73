"""What a rank's share of a decode step costs the host and the device, measured apart.

    .venv/bin/python bench/bench_launch.py [--shape llama3-8b | --model PATH] [--layers 16,32]
        [--steps 200]

One process, one stream, a KV cache filled by a short prompt. For each layer count k it
times, step by step, the three phases of running the first k layers on one token's hidden
state: building the graph in Python, launching it (`mx.async_eval` returning: MLX
encodes every kernel), and waiting for the device to finish after that. A pipeline rank
that may not launch before its input has arrived (a CUDA rank settles its receives, see
`Ring`) pays launch + wait on the token's path for its layers; one process overlaps the
launch of step t+1 with the device's work on step t. So on N ranks a token costs at
least the sum over ranks of (launch + wait) plus one ring round trip (`bench_hop.py`):
this prints that bound for an even split, against one process's step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import shapes  # noqa: E402


def time_layers(model, cache, hidden: mx.array, k: int, steps: int) -> dict[str, float]:
    """Median milliseconds of build, launch and wait for the first k layers, one token."""
    build, launch, wait = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        h = hidden
        for layer, c in zip(model.layers[:k], cache[:k], strict=True):
            h = layer(h, None, c)
        t1 = time.perf_counter()
        mx.async_eval(h)
        t2 = time.perf_counter()
        mx.eval(h)
        t3 = time.perf_counter()
        build.append(t1 - t0)
        launch.append(t2 - t1)
        wait.append(t3 - t2)
    return {
        name: 1000 * statistics.median(xs)
        for name, xs in (("build", build), ("launch", launch), ("wait", wait))
    }


def time_generation(model, tokens: mx.array, steps: int) -> float:
    """Median milliseconds per token of mlx-lm's own generator (it overlaps the launch)."""
    from mlx_lm.generate import generate_step

    times, last = [], time.perf_counter()
    for i, _ in enumerate(generate_step(tokens, model, max_tokens=steps + 1)):
        now = time.perf_counter()
        if i:
            times.append(now - last)
        last = now
    return 1000 * statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=shapes.NAMES, default="tiny")
    ap.add_argument("--model", help="a model directory (instead of --shape)")
    ap.add_argument("--layers", default="", help="layer counts (default: half and all)")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()

    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    path = args.model or str(shapes.make_shape(args.shape, shapes.cache_dir() / args.shape))
    model, tokenizer = load(path)
    prompt = mx.array(tokenizer.encode("Write a long story about a lighthouse keeper.")[:32])
    print(f"model {path}  device {mx.default_device()}  steps {args.steps}")
    gen_ms = time_generation(model, prompt, args.steps)
    print(f"mlx-lm generate_step: {gen_ms:.2f} ms a token")

    inner = model.model if hasattr(model, "model") else model
    n = len(inner.layers)
    counts = [int(x) for x in args.layers.split(",")] if args.layers else [n // 2, n]
    cache = make_prompt_cache(model)
    model(prompt[None], cache=cache)  # fill the cache as a prefill would
    mx.eval([c.state for c in cache])
    hidden = inner.embed_tokens(prompt[None, -1:])
    mx.eval(hidden)
    print(f"{'layers':>7}{'build ms':>10}{'launch ms':>11}{'wait ms':>9}{'launch+wait':>13}")
    spans = {}
    for k in counts:
        t = time_layers(inner, cache, hidden, k, args.steps)
        spans[k] = t["launch"] + t["wait"]
        print(f"{k:>7}{t['build']:>10.2f}{t['launch']:>11.2f}{t['wait']:>9.2f}{spans[k]:>13.2f}")
    if n // 2 in spans:
        bound = 2 * spans[n // 2]
        print(
            f"2 ranks, settled receives: a token >= 2 x {spans[n // 2]:.2f} ms + one ring round"
            f" trip = {bound:.2f} ms + trip; one process {gen_ms:.2f} ms:"
            f" ratio <= {gen_ms / bound:.3f} before the trip"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
