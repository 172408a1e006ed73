"""What an all-sum costs a tensor-parallel step: the link's latency and the host's time.

    .venv/bin/python bench/bench_all_sum.py [--ranks 2] [--gpus G] [--hidden 8192]
        [--layers 80] [--rounds 20] [--settings default,MLX_USE_CUDA_GRAPHS=0]

A split layer (mlx-lm's `shard()`) sums its slices' outputs across the group twice, so a
token of an L-layer model on a tensor group runs 2L all-sums of one token's hidden state.
This measures, on `--ranks` processes (NCCL between `--gpus` CUDA GPUs, else MLX's ring
backend on this machine), three chains of 2L links evaluated at once, as a decode step is:

- `bare`: all-sums alone, each on the one before: the link's round trip, the floor under
  any split step's time a token (the issue's "measured lower bound");
- `layer`: a small matmul then an all-sum, 2L times: a step's shape with little compute;
- `local`: the same with the all-sum replaced by a multiply: `layer` less `local` is
  what the all-sums add to a step, in wall time and in the host's CPU time.

Each figure is the median over `--rounds` evaluations (after warm-ups), in ms per chain
(a token) and in microseconds per link; CPU time is rank 0's process time (user +
system), which on a GPU is the host's work: MLX records kernels and NCCL calls into CUDA
graphs on the host. Every `--settings` entry (environment settings for the ranks, or
`default`) runs its own processes, one after another, so MLX reads them at start.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

CHAINS = ("bare", "layer", "local")


def rank_main(hidden: int, layers: int, rounds: int, backend: str) -> None:
    """One rank: time the three chains and (rank 0) print them as one JSON line."""
    import mlx.core as mx

    group = mx.distributed.init(backend=backend, strict=True)
    n = group.size()
    dtype = mx.bfloat16 if mx.cuda.is_available() else mx.float32  # (no bf16 matmul on CPU)
    x0 = mx.ones((1, hidden), dtype)
    w = (mx.random.normal((hidden, hidden // n)) * hidden**-0.5).astype(dtype)
    wt = (mx.random.normal((hidden // n, hidden)) * hidden**-0.5).astype(dtype)
    mx.eval(x0, w, wt)

    def chain(kind: str) -> mx.array:
        x = x0
        for _ in range(2 * layers):
            if kind == "bare":
                x = mx.distributed.all_sum(x, group=group) * (1.0 / n)
            else:
                y = (x @ w) @ wt
                y = mx.distributed.all_sum(y, group=group) if kind == "layer" else y * 1.0
                x = x + y
        return x

    timings: dict[str, dict[str, float]] = {}
    for kind in CHAINS:
        walls, cpus = [], []
        for i in range(rounds + 3):
            c0, t0 = time.process_time(), time.perf_counter()
            mx.eval(chain(kind))
            if i >= 3:  # (warm-ups: kernels and graphs compile)
                walls.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
        timings[kind] = {
            "wall_ms": statistics.median(walls) * 1e3,
            "cpu_ms": statistics.median(cpus) * 1e3,
        }
    if group.rank() == 0:
        print(json.dumps(timings), flush=True)


def run_setting(setting: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Start the ranks with `setting`'s environment, wait for them, return rank 0's line."""
    from bench_pipeline import gpu_env, group_env

    env = {**os.environ, **group_env(args.ranks, args.gpus)}
    if setting != "default":
        env |= dict(kv.split("=", 1) for kv in setting.split("+"))
    procs = []
    for r in range(args.ranks):
        rank_env = {**env, "MLX_RANK": str(r), **gpu_env(r, args.gpus)}
        cmd = [sys.executable, __file__, "--rank-of", env["BENCH_BACKEND"]]
        cmd += [
            "--hidden",
            str(args.hidden),
            "--layers",
            str(args.layers),
            "--rounds",
            str(args.rounds),
        ]
        procs.append(subprocess.Popen(cmd, env=rank_env, stdout=subprocess.PIPE, text=True))
    out = procs[0].communicate(timeout=600)[0]
    for p in procs[1:]:
        p.wait(60)
    if any(p.returncode for p in procs):
        raise SystemExit(f"{setting}: a rank failed (exit codes {[p.returncode for p in procs]})")
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--gpus", type=int, default=0, help="CUDA: rank r on GPU r mod G, over NCCL")
    ap.add_argument("--hidden", type=int, default=8192, help="a token's hidden size (70B: 8192)")
    ap.add_argument("--layers", type=int, default=80, help="layers a token crosses (2 links each)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument(
        "--settings",
        default="default",
        help="comma-separated rank environments, each KEY=V[+KEY=V] or default",
    )
    ap.add_argument("--rank-of", help=argparse.SUPPRESS)  # (a rank process, with its backend)
    args = ap.parse_args()
    if args.rank_of:
        rank_main(args.hidden, args.layers, args.rounds, args.rank_of)
        return 0
    links = 2 * args.layers
    print(
        f"{args.ranks} ranks, {'NCCL on GPUs' if args.gpus else 'ring on CPU'}, hidden {args.hidden}, {links} links a chain"
    )
    print(
        f"{'setting':34} {'chain':6} {'wall ms':>8} {'cpu ms':>8} {'wall us/link':>13} {'cpu us/link':>12}"
    )
    for setting in args.settings.split(","):
        t = run_setting(setting, args)
        for kind in CHAINS:
            w, c = t[kind]["wall_ms"], t[kind]["cpu_ms"]
            print(
                f"{setting:34} {kind:6} {w:8.2f} {c:8.2f} {w * 1e3 / links:13.1f} {c * 1e3 / links:12.1f}"
            )
        added_w = (t["layer"]["wall_ms"] - t["local"]["wall_ms"]) * 1e3 / links
        added_c = (t["layer"]["cpu_ms"] - t["local"]["cpu_ms"]) * 1e3 / links
        print(
            f"{setting:34} an all-sum adds {added_w:.1f} us of wall and {added_c:.1f} us of host CPU to a step"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
