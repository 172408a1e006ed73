"""The engine alone against mlx-lm: one process, no gRPC, no client, no ring.

    .venv/bin/python bench/bench_engine.py [--shape tiny | --model PATH] [--tokens 256]
        [--rounds 5] [--core 0]

`bench_pipeline.py` measures what a user gets: a cluster behind its gRPC front door,
read by a client. On a CPU where a token costs a few milliseconds and each rank has one
core, that figure includes the front door's and the client's work per token, which
share the core with the computation. This runs rank 0's engine in process on a
one-rank pipeline (the same Engine, Pipeline and sampling as a served cluster) and
mlx-lm's `stream_generate` in the same process, taking turns, pinned to one core
(`--core -1`: not pinned), so the ratio is the engine's own per-step cost and nothing else.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import shapes  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper and the sea."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=shapes.NAMES, default="tiny")
    ap.add_argument("--model", help="a model directory (instead of --shape)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--core", type=int, default=0, help="the core to pin to (-1: none)")
    args = ap.parse_args()
    if args.core >= 0:  # (before MLX starts its threads, so they inherit it)
        os.sched_setaffinity(0, {args.core})

    import mlx.core as mx
    from mlx_lm import load, stream_generate

    from mlx_relay.coordinator.config import EngineConfig
    from mlx_relay.coordinator.engine import Engine
    from mlx_relay.coordinator.pipeline import Pipeline
    from mlx_relay.coordinator.sampling import SamplingParams
    from mlx_relay.coordinator.sequence import Request

    path = args.model or str(shapes.make_shape(args.shape, shapes.cache_dir() / args.shape))
    model, tokenizer = load(path)
    ids = tokenizer.encode(PROMPT)
    tokenizer.eos_token_ids = set()  # (as ignore_eos: every run makes --tokens tokens)

    def decode_rate(tokens_of) -> float:
        """Decode tokens a second after the first token, over one run's stream."""
        first, count = None, 0
        for n in tokens_of():
            count += n
            if first is None and n:
                first = time.perf_counter()
        return (count - 1) / (time.perf_counter() - first)

    def mlx_lm_run():
        for _ in stream_generate(model, tokenizer, mx.array(ids), max_tokens=args.tokens):
            yield 1

    engine = Engine(Pipeline(None, None), EngineConfig(prompt_cache=False))
    engine.start()
    engine.load(path).result()

    def engine_run():
        params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
        request = engine.submit(Request(prompt_tokens=list(ids), params=params))
        for chunk in request.chunks():
            yield len(chunk.token_ids)

    decode_rate(mlx_lm_run)  # warm-up, each
    decode_rate(engine_run)
    print(f"model {path}  tokens {args.tokens}  rounds {args.rounds}  core {args.core}")
    print(f"{'round':>5}{'mlx-lm tok/s':>14}{'engine tok/s':>14}{'ratio':>8}")
    ratios = []
    for i in range(args.rounds):
        base, ours = decode_rate(mlx_lm_run), decode_rate(engine_run)
        ratios.append(ours / base)
        print(f"{i + 1:>5}{base:>14.1f}{ours:>14.1f}{ours / base:>8.3f}", flush=True)
    print(f"median ratio {statistics.median(ratios):.3f}")
    engine.free(shutdown=True).result()
    engine.join(10)
    # Arrays the engine left in reference cycles go now: freed at interpreter teardown,
    # after MLX's own state, they abort the process ("terminate called without an
    # active exception"; seen with MLX 0.32.4).
    gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
