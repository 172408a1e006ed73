"""Concurrent load: aggregate decode throughput, pipelining efficiency, TTFT under load, idle CPU.

    .venv/bin/python bench/bench_concurrency.py [--model default | --shape NAME] [--tokens 48]
        [--streams 1,2,4,8] [--ranks 1,2,3] [--idle-seconds 30] [--gpus G]
        [--hop-modes auto] [--steps-in-flight 0] [--layouts pipeline,tensor] [--mlx-lm-server]

Each rank is pinned to its own core (rank i -> core i mod cores) and stands for one
machine. Throughput is measured in the steady state: from the moment every stream has
its first token to the moment the first stream ends, counting every token produced in
that window. Pipelining efficiency compares C streams on N ranks with N times one rank
serving C/N streams, so batching alone does not count; the speed-up over one rank
serving the same C streams is printed too. `--shape` and `--gpus` are as in
bench_pipeline.py (a random-weight model of a real shape; rank r on GPU r mod G).
`--hop-modes eager,ready` runs each multi-rank size once per hop mode, and
`--steps-in-flight 0,3` once per value of the server's option (0: one step a rank). `--mlx-lm-server`
adds mlx-lm's own distributed server (`mlx_lm.server --pipeline`, one process per rank on
the same ring backend and GPUs, streams over its OpenAI HTTP API) at the largest rank
count, for the same streams. `--layouts pipeline,tensor` runs each multi-rank size also
with every layer split across its ranks (`--tensor-parallel N`, rows "N TPN") and prints
each split row's aggregate against the pipeline's of the same ranks and streams.
MLX_RELAY_BENCH_SERVE_ARGS adds options to every cluster's `serve` (e.g.
"--step-timeout 400": on a fresh 2x H200 host, before the warm-up ran decode groups,
16 streams of the 70B shape met a step past the default 30 s; bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import subprocess
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
    return _window_rate(stamps)


def _window_rate(stamps: list[list[float]]) -> float:
    """Tokens a second while every stream is producing: from the last first token to the
    first last token."""
    if not all(stamps):
        return float("nan")
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
    model: str,
    n: int,
    layers: str,
    gpus: int,
    max_active: int,
    hop_mode: str = "auto",
    steps_in_flight: int = 0,
    tensor: int = 1,
) -> tuple[LocalCluster, Client]:
    address = f"127.0.0.1:{free_ports(1)[0]}"
    logs = Path(tempfile.mkdtemp(prefix="bench-logs-"))
    # Without the prompt cache: the streams repeat one prompt, and this measures scheduling.
    serve = ["--model", model, "--max-active", str(max_active), "--no-prompt-cache"]
    serve += ["--hop-mode", hop_mode, "--steps-in-flight", str(steps_in_flight)]
    serve += ["--layers", layers] if layers else []
    serve += ["--tensor-parallel", str(tensor)] if tensor > 1 else []
    serve += shlex.split(os.environ.get("MLX_RELAY_BENCH_SERVE_ARGS", ""))
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


# mlx_lm.server picks its backend with a plain init(); the ring backend is initialised
# first so that a CUDA machine does not try NCCL.
_MLX_LM_SERVER = (
    "import sys, mlx.core as mx; mx.distributed.init(backend='ring', strict=True); "
    "from mlx_lm.server import main; sys.argv = ['mlx_lm.server', *sys.argv[1:]]; main()"
)


class MlxLmServer:
    """mlx-lm's distributed server (`--pipeline`) on n ranks: the reference for C streams."""

    def __init__(self, model: str, n: int, gpus: int, concurrency: int) -> None:
        ports = free_ports(n + 1)
        self.port = ports[n]
        workdir = Path(tempfile.mkdtemp(prefix="bench-mlx-lm-"))
        hostfile = workdir / "hostfile.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports[:n]]))
        argv = ["--model", model, "--pipeline", "--port", str(self.port)]
        argv += ["--decode-concurrency", str(concurrency), "--max-tokens", "100000"]
        self.procs = []
        for rank in range(n):
            env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
            env.update(gpu_env(rank, gpus))
            log = open(workdir / f"rank{rank}.log", "wb")  # noqa: SIM115 - lives with the process
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _MLX_LM_SERVER, *argv],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        self.logs = workdir
        deadline = time.monotonic() + 600
        while True:
            try:
                self._stream(0, 2, [])
                break
            except OSError as e:
                if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                    self.close()
                    raise RuntimeError(f"mlx_lm.server did not start; logs in {workdir}") from e
                time.sleep(1)

    def _stream(self, i: int, tokens: int, stamps: list[float]) -> None:
        """One streamed chat completion; a stamp per token (the final usage chunk's count
        spreads over the chunks, which may each carry more than one token)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=900)
        body = {
            "messages": [{"role": "user", "content": f"Tell story number {i} about the sea."}],
            "max_tokens": tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.0,
        }
        conn.request("POST", "/v1/chat/completions", json.dumps(body))
        response = conn.getresponse()
        if response.status != 200:
            why = response.read()[:300].decode(errors="replace")  # (its error, as JSON)
            raise OSError(f"mlx_lm.server: HTTP {response.status}: {why}")
        chunks: list[float] = []
        used = 0
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                used = event["usage"]["completion_tokens"]
            if event.get("choices"):
                chunks.append(time.perf_counter())
        conn.close()
        per_chunk = used / len(chunks) if chunks and used else 1.0
        for t in chunks:
            stamps.extend([t] * max(1, round(per_chunk)))

    def steady_throughput(self, streams: int, tokens: int) -> float:
        stamps: list[list[float]] = [[] for _ in range(streams)]
        threads = [
            threading.Thread(target=self._stream, args=(i, tokens, stamps[i]))
            for i in range(streams)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return _window_rate(stamps)

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


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
        "which gives rank 0 fewer layers for the LM head it also runs); given more than "
        "once for one N, each split runs as a row of its own",
    )
    ap.add_argument("--shape", choices=shapes.NAMES, help="a random-weight model of this shape")
    ap.add_argument("--gpus", type=int, default=0, help="CUDA: rank r runs on GPU r mod G")
    ap.add_argument("--max-active", type=int, default=16)
    ap.add_argument(
        "--hop-modes",
        default="auto",
        help="comma-separated --hop-mode values: each multi-rank size runs once per mode",
    )
    ap.add_argument(
        "--steps-in-flight",
        default="0",
        help="comma-separated --steps-in-flight values (0: one a rank): each multi-rank "
        "size runs once per value and hop mode",
    )
    ap.add_argument(
        "--layouts",
        default="pipeline",
        help="comma-separated: pipeline (a layer range a rank), tensor (--tensor-parallel N: "
        "every layer split across the N ranks); each multi-rank size runs once per layout",
    )
    ap.add_argument(
        "--mlx-lm-server",
        action="store_true",
        help="also run mlx_lm.server --pipeline at the largest rank count",
    )
    args = ap.parse_args()
    if args.shape:
        args.model = str(shapes.make_shape(args.shape, shapes.cache_dir() / args.shape))
    streams = [int(x) for x in args.streams.split(",")]
    ranks = [int(x) for x in args.ranks.split(",")]
    modes = args.hop_modes.split(",")
    depths = [int(x) for x in args.steps_in_flight.split(",")]
    layouts = args.layouts.split(",")
    print(f"model {args.model}  tokens/stream {args.tokens}  cores {psutil.cpu_count()}")

    splits: dict[int, list[str]] = {}
    for item in args.layers:
        n, split = item.split("=", 1)
        splits.setdefault(int(n), []).append(split)
    table: dict[tuple[str, int], float] = {}
    rows: dict[str, int] = {}  # row label -> its rank count
    configs = [
        (size, mode, depth, split, layout)
        for size in ranks
        for layout in (layouts if size > 1 else ["pipeline"])
        for mode in (modes if size > 1 else ["auto"])
        for depth in (depths if size > 1 else [0])
        # (a split layout takes no --layers: the ranks hold every layer, a share of each)
        for split in (splits.get(size, ["balanced"]) if layout == "pipeline" else [""])
    ]
    split_of: dict[str, str] = {}  # a tensor row -> the pipeline row of its ranks and options
    for n, mode, depth, split, layout in configs:
        row = f"{n}" + (f" {mode}" if n > 1 and len(modes) > 1 else "")
        row += f" {depth or n} in flight" if n > 1 and len(depths) > 1 else ""
        row += f" {split}" if len(splits.get(n, [])) > 1 else ""
        if layout == "tensor":
            split_of[f"{row} TP{n}"] = row
            row += f" TP{n}"
        rows[row] = n
        # (the first configuration of this rank count also measures TTFT and idle CPU)
        first = (n, mode, depth, split, layout) == next(c for c in configs if c[0] == n)
        tensor = n if layout == "tensor" else 1
        cluster, client = start(
            args.model, n, split, args.gpus, args.max_active, mode, depth, tensor
        )
        try:
            # One rank also serves C/N streams: the pipelining efficiency's reference.
            shares = {max(1, c // m) for c in streams for m in ranks}
            for c in sorted(set(streams) | shares) if n == 1 else streams:
                table[(row, c)] = steady_throughput(client, c, args.tokens)
                print(f"  {row} rank(s), {c} stream(s): {table[(row, c)]:.2f} tok/s", flush=True)
            if n == max(ranks) and first:
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
    if args.mlx_lm_server:
        n = max(ranks)
        row = f"mlx_lm.server {n}"
        rows[row] = n
        server = MlxLmServer(args.model, n, args.gpus, args.max_active)
        try:
            for c in streams:
                table[(row, c)] = server.steady_throughput(c, args.tokens)
                print(f"  {row} rank(s), {c} stream(s): {table[(row, c)]:.2f} tok/s", flush=True)
        finally:
            server.close()

    width = max(len(r) for r in rows) + 1
    print("\naggregate decode tok/s")
    print(f"{'ranks':<{width}}" + "".join(f"{f'C={c}':>10}" for c in streams))
    for row in rows:
        cells = [table.get((row, c), float("nan")) for c in streams]
        print(f"{row:<{width}}" + "".join(f"{v:>10.2f}" for v in cells))
    print("\npipelining efficiency: tput(N ranks, C) / (N x tput(1 rank, C/N)); target >= 0.8")
    for row, n in rows.items():
        if n == 1:
            continue
        cells = []
        for c in streams:
            base = table.get(("1", max(1, c // n)))
            cells.append(table[(row, c)] / (n * base) if base and c >= n else float("nan"))
        print(f"{row:<{width}}" + "".join(f"{v:>10.2f}" for v in cells))
    print("\nspeed-up over 1 rank serving the same C streams")
    for row in rows:
        cells = [
            table[(row, c)] / table[("1", c)] if ("1", c) in table else float("nan")
            for c in streams
        ]
        print(f"{row:<{width}}" + "".join(f"{v:>10.2f}" for v in cells))
    if split_of:
        print("\ntensor parallel against the pipeline of the same ranks (same streams)")
        for row, pipeline in split_of.items():
            if pipeline in rows:
                cells = [table[(row, c)] / table[(pipeline, c)] for c in streams]
                print(f"{row:<{width}}" + "".join(f"{v:>10.2f}" for v in cells))
    server_rows = [r for r in rows if r.startswith("mlx_lm.server")]
    for ref in server_rows:
        print(f"\nratio to {ref} (same streams)")
        for row in rows:
            if row in server_rows or rows[row] != rows[ref]:
                continue
            cells = [table[(row, c)] / table[(ref, c)] for c in streams]
            print(f"{row:<{width}}" + "".join(f"{v:>10.2f}" for v in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
