"""Concurrent load: aggregate decode throughput, pipelining efficiency, TTFT under load, idle CPU.

    .venv/bin/python bench/bench_concurrency.py [--model default | --shape NAME] [--tokens 48]
        [--streams 1,2,4,8] [--ranks 1,2,3] [--idle-seconds 30] [--gpus G]

Each rank is pinned to its own core (rank i -> core i mod cores) and stands for one
machine. Throughput is measured in the steady state: from the moment every stream has
its first token to the moment the first stream ends, counting every token produced in
that window. Pipelining efficiency compares C streams on N ranks with N times one rank
serving C/N streams, so batching alone does not count; the speed-up over one rank
serving the same C streams is printed too. `--shape` and `--gpus` are as in
bench_pipeline.py (a random-weight model of a real shape; rank r on GPU r mod G).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import shapes  # noqa: E402
from bench_pipeline import gpu_env  # noqa: E402

from mlx_relay.client.client import Client  # noqa: E402
from mlx_relay.launch.local import LocalCluster, free_ports  # noqa: E402
from mlx_relay.protocol import relay_pb2 as pb  # noqa: E402


def _request(i: int, tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content=f"Tell story number {i} about the sea.")],
        params=pb.SamplingParams(max_tokens=tokens, ignore_eos=True),
    )


def _stream(client: Client, request: pb.GenerateRequest, stamps: list[float]) -> None:
    for chunk in client.stream(request):
        now = time.perf_counter()
        stamps.extend([now] * len(chunk.token_ids))


def steady_throughput(client: Client, streams: int, tokens: int) -> float:
    stamps: list[list[float]] = [[] for _ in range(streams)]
    threads = [
        threading.Thread(target=_stream, args=(client, _request(i, tokens), stamps[i]))
        for i in range(streams)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start = max(s[0] for s in stamps)
    end = min(s[-1] for s in stamps)
    inside = sum(1 for s in stamps for t in s if start < t <= end)
    return inside / (end - start) if end > start else float("nan")


def ttft(client: Client) -> float:
    t0 = time.perf_counter()
    for chunk in client.stream(_request(99, 1)):
        if chunk.token_ids:
            return time.perf_counter() - t0
    return float("nan")


def ttft_under_load(client: Client, busy: int, tokens: int) -> tuple[float, float]:
    idle = min(ttft(client) for _ in range(3))
    stamps: list[list[float]] = [[] for _ in range(busy)]
    threads = [
        threading.Thread(target=_stream, args=(client, _request(i, tokens), stamps[i]))
        for i in range(busy)
    ]
    for t in threads:
        t.start()
    while not all(stamps):
        time.sleep(0.05)
    loaded = min(ttft(client) for _ in range(3))
    for t in threads:
        t.join()
    return idle, loaded


def idle_cpu(cluster: LocalCluster, seconds: float) -> list[float]:
    procs = [psutil.Process(p.pid) for p in cluster.procs]
    before = [sum(p.cpu_times()[:2]) for p in procs]
    time.sleep(seconds)
    after = [sum(p.cpu_times()[:2]) for p in procs]
    return [(a - b) / seconds * 100 for a, b in zip(after, before, strict=True)]


def start(
    model: str, n: int, layers: str, gpus: int, max_active: int
) -> tuple[LocalCluster, Client]:
    address = f"127.0.0.1:{free_ports(1)[0]}"
    logs = Path(tempfile.mkdtemp(prefix="bench-logs-"))
    # Without the prompt cache: the streams repeat one prompt, and this measures scheduling.
    serve = ["--model", model, "--max-active", str(max_active), "--no-prompt-cache"]
    serve += ["--layers", layers] if layers else []
    cluster = LocalCluster(
        n,
        serve,
        grpc_address=address,
        log_dir=logs,
        pin=gpus == 0,
        rank_env={r: gpu_env(r, gpus) for r in range(n)},
    )
    cluster.start()
    cluster.wait_serving(600)
    client = Client(address, timeout=900)
    steady_throughput(client, 1, 4)  # warm up
    return cluster, client


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--ranks", default="1,2,3")
    ap.add_argument("--idle-seconds", type=float, default=30.0)
    ap.add_argument(
        "--layers",
        action="append",
        default=[],
        help="N=SPLIT: the --layers of N ranks, e.g. 2=11,19 or 3=auto (default: balanced, "
        "which gives rank 0 fewer layers for the LM head it also runs)",
    )
    ap.add_argument("--shape", choices=shapes.NAMES, help="a random-weight model of this shape")
    ap.add_argument("--gpus", type=int, default=0, help="CUDA: rank r runs on GPU r mod G")
    ap.add_argument("--max-active", type=int, default=16)
    args = ap.parse_args()
    if args.shape:
        args.model = str(shapes.make_shape(args.shape, shapes.cache_dir() / args.shape))
    streams = [int(x) for x in args.streams.split(",")]
    ranks = [int(x) for x in args.ranks.split(",")]
    print(f"model {args.model}  tokens/stream {args.tokens}  cores {psutil.cpu_count()}")

    splits = dict(item.split("=", 1) for item in args.layers)
    table: dict[tuple[int, int], float] = {}
    for n in ranks:
        cluster, client = start(
            args.model, n, splits.get(str(n), "balanced"), args.gpus, args.max_active
        )
        try:
            for c in sorted(
                set(streams) | {max(1, c // n) for c in streams} if n == 1 else streams
            ):
                table[(n, c)] = steady_throughput(client, c, args.tokens)
                print(f"  {n} rank(s), {c} stream(s): {table[(n, c)]:.2f} tok/s", flush=True)
            if n == max(ranks):
                idle, loaded = ttft_under_load(client, 4, args.tokens * 4)
                print(
                    f"\nTTFT of a 1-token request on {n} ranks: idle {idle * 1000:.0f} ms, "
                    f"with 4 long generations running {loaded * 1000:.0f} ms "
                    f"(ratio {loaded / idle:.2f}, target < 2)"
                )
                cpu = idle_cpu(cluster, args.idle_seconds)
                print(
                    f"idle CPU over {args.idle_seconds:.0f} s, per rank: "
                    + ", ".join(f"rank {r} {v:.1f}%" for r, v in enumerate(cpu))
                )
        finally:
            client.close()
            cluster.stop()

    print("\naggregate decode tok/s")
    print("ranks " + "".join(f"{f'C={c}':>10}" for c in streams))
    for n in ranks:
        print(f"{n:>5} " + "".join(f"{table.get((n, c), float('nan')):>10.2f}" for c in streams))
    print("\npipelining efficiency: tput(N ranks, C) / (N x tput(1 rank, C/N)); target >= 0.8")
    for n in ranks:
        if n == 1:
            continue
        cells = []
        for c in streams:
            base = table.get((1, max(1, c // n)))
            cells.append(table[(n, c)] / (n * base) if base and c >= n else float("nan"))
        print(f"{n:>5} " + "".join(f"{v:>10.2f}" for v in cells))
    print("\nspeed-up over 1 rank serving the same C streams")
    for n in ranks:
        cells = [
            table[(n, c)] / table[(1, c)] if (1, c) in table else float("nan") for c in streams
        ]
        print(f"{n:>5} " + "".join(f"{v:>10.2f}" for v in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
