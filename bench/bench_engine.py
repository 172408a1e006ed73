"""The engine alone against mlx-lm: one process, no gRPC, no client, no ring.

    .venv/bin/python bench/bench_engine.py [--shape tiny | --model PATH] [--tokens 256]
        [--rounds 5] [--core 0] [--profile 25]

`bench_pipeline.py` measures what a user gets: a cluster behind its gRPC front door,
read by a client. On a CPU where a token costs a few milliseconds and each rank has one
core, that figure includes the front door's and the client's work per token, which
share the core with the computation. This runs rank 0's engine in process on a
one-rank pipeline (the same Engine, Pipeline and sampling as a served cluster) and
mlx-lm's `stream_generate` in the same process, taking turns, pinned to one core
(`--core -1`: not pinned), so the ratio is the engine's own per-step cost and nothing else.

`--profile N` runs one more round of each under cProfile (the engine's thread and the
mlx-lm loop's) and prints each side's N functions with the most time of their own, in
microseconds a token: where the engine's host time a token goes that mlx-lm's does not.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
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
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="print N functions")
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
    if args.profile:
        for name, run, on_its_thread in (
            ("mlx-lm", mlx_lm_run, lambda fn: fn()),
            ("engine", engine_run, lambda fn: engine.call(fn).result()),
        ):
            profiler = cProfile.Profile()
            on_its_thread(profiler.enable)  # (cProfile sees only the thread enabling it)
            decode_rate(run)
            on_its_thread(profiler.disable)
            print_profile(name, profiler, args.tokens, args.profile)
    engine.free(shutdown=True).result()
    engine.join(10)
    # Arrays the engine left in reference cycles go now: freed at interpreter teardown,
    # after MLX's own state, they abort the process ("terminate called without an
    # active exception"; seen with MLX 0.32.4).
    gc.collect()
    return 0


def print_profile(name: str, profiler: cProfile.Profile, tokens: int, top: int) -> None:
    """The `top` functions by their own time, in microseconds a token."""
    stats = pstats.Stats(profiler).stats  # {(file, line, fn): (cc, nc, tottime, cumtime, _)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])
    total = sum(v[2] for v in stats.values())
    print(f"\n{name}: {total / tokens * 1e6:.0f} us a token in profiled functions")
    for (file, line, fn), (_, calls, own, _, _) in rows[:top]:
        where = f"{Path(file).parent.name}/{Path(file).name}:{line}" if line else file
        print(f"{own / tokens * 1e6:>8.1f}{calls / tokens:>7.1f}  {fn} ({where})")


if __name__ == "__main__":
    sys.exit(main())
