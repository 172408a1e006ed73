"""Single-stream speed of 1, 2 and 3 ranks against single-process mlx-lm, side by side.

    .venv/bin/python bench/bench_pipeline.py [--model default | --shape tiny] [--tokens 128]
        [--rounds 5] [--ranks 1,2,3] [--gpus G] [--hop-modes eager,ready]
        [--layouts pipeline,tensor,auto]

Every configuration runs in this one invocation on the same model and prompt, so the
printed ratios compare like with like on whatever machine runs it. All of them stay
loaded and take turns, one request each per round: a slow minute on a shared machine
then hits every configuration alike instead of one of them (run to run, the old
one-configuration-after-another order moved the 1-rank ratio between 0.90 and 1.07). Each rank
(every thread of it) is pinned to `--cores-per-rank` cores of its own (rank i -> the i-th run
of cores, wrapping), standing for one machine; the mlx-lm baseline runs in a subprocess
pinned like rank 0. A rank is several busy threads (MLX's stream, the ring backend's, zmq,
the engine), so one core per rank starves it where a real machine would not. The benchmark's own gRPC client is pinned
to core 0 too: left free, it lands on rank 1's core and takes time from it (measured:
2 ranks 0.87-0.98 of mlx-lm with the client free, 0.997 with it pinned), so the cost
of the client falls on rank 0's core, as a client on the coordinator's machine would.
`--client-core free` puts it instead on a core that no rank of the configuration uses,
where one is left (1 rank on a 2-core machine): a client of its own, as the baseline,
which has none, never shares its core with one.

Each run also counts the CPU time (user + system) of every process it involves: the
baseline's, each rank's and this one's (the client's), per generated token, beside the
run's wall time per token. With a core per rank, a rank whose CPU time per token nears the
token's wall time is the bound: rank 0's includes the gRPC front door's work, and the
client's shares rank 0's core.

Clusters run without the prompt cache: every round repeats the prompt, which the cache
would serve from memory, while the baseline prefills it each time.

`--shape` builds a random-weight model of a real shape (bench/shapes.py): `tiny` shows
the engine's per-step costs on a CPU. `--gpus G` runs on CUDA: rank r gets GPU r mod G
(one GPU stands for one machine), the baseline GPU 0, and nothing is pinned to cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402
import shapes  # noqa: E402

from mlx_relay.client.client import Client  # noqa: E402
from mlx_relay.launch.local import LocalCluster, free_ports  # noqa: E402
from mlx_relay.protocol import relay_pb2 as pb  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
FILLER = "The lighthouse stood on the rocks, and every night its lamp swept the sea. "


def make_prompt(tokens: int) -> str:
    """The story prompt, after about `tokens` tokens of filler when a long one is wanted."""
    return FILLER * max(0, tokens // 16) + PROMPT


BASELINE = r"""
import json, os, sys, time
if os.environ.get("BENCH_CORES"):  # before MLX starts its threads, so they inherit it
    os.sched_setaffinity(0, {int(c) for c in os.environ["BENCH_CORES"].split(",")})
import mlx.core as mx
from mlx_lm import load, stream_generate
path, n = sys.argv[1], int(sys.argv[2])
model, tok = load(path)
text = tok.apply_chat_template([{"role": "user", "content": sys.argv[3]}], tokenize=False,
                               add_generation_prompt=True)
ids = tok.encode(text, add_special_tokens=False)
tok.eos_token_ids = set()  # like ignore_eos: always generate n tokens
print(json.dumps({"prompt_tokens": len(ids)}), flush=True)
for line in sys.stdin:  # one run per line, so runs interleave with the clusters'
    t0 = time.perf_counter(); first = None; count = 0
    for r in stream_generate(model, tok, mx.array(ids), max_tokens=n):
        count += 1
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    print(json.dumps({"ttft": first - t0, "decode_tps": (count - 1) / (end - first)}), flush=True)
"""


# mlx-lm's own tensor parallelism (`sharded_load(path, tensor_group=...)`), one process
# a rank, each reading the same run lines: the reference `--layouts mlx-lm-tensor` adds.
# (sharded_load's own steps less its closing barrier, an all-sum on the CPU stream that
# MLX's NCCL backend refuses: "There is no Stream(gpu, 1) in current thread")
TENSOR_BASELINE = BASELINE.replace(
    "model, tok = load(path)\n",
    "group = mx.distributed.init(backend=os.environ['BENCH_BACKEND'], strict=True)\n"
    "model, tok = load(path, lazy=True)\n"
    "model.shard(group)\n"
    "mx.eval(model.parameters())\n",
)


def group_env(n: int, gpus: int) -> dict[str, str]:
    """The environment (rank 0's: each rank adds MLX_RANK and `gpu_env`) under which `n`
    processes on this machine form one mx.distributed group: NCCL between GPUs, else
    the ring backend; BENCH_BACKEND names the backend for `mx.distributed.init`."""
    ports = free_ports(n + 1)
    hostfile = Path(tempfile.mkdtemp()) / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports[:n]]))
    env = {"MLX_HOSTFILE": str(hostfile), "MLX_WORLD_SIZE": str(n)}
    if gpus:
        return env | {
            "BENCH_BACKEND": "nccl",
            "NCCL_HOST_IP": "127.0.0.1",
            "NCCL_PORT": str(ports[n]),
        }
    return env | {"BENCH_BACKEND": "ring"}


class ShardedBaseline:
    """mlx-lm's own split generation on `n` processes (NCCL between GPUs, else the ring
    backend on this machine), kept loaded; rank 0's timings are the run's."""

    def __init__(self, path: Path, tokens: int, prompt: str, n: int, gpus: int) -> None:
        common = group_env(n, gpus)
        self.ranks = [
            Baseline(
                path,
                tokens,
                prompt,
                {**common, "MLX_RANK": str(r), **gpu_env(r, gpus)},
                script=TENSOR_BASELINE,
                wait=False,
            )  # fmt: skip
            for r in range(n)
        ]
        for rank in self.ranks:
            rank.started()
        self.proc = self.ranks[0].proc
        self.prompt_tokens = self.ranks[0].prompt_tokens

    def run(self) -> dict:
        for rank in self.ranks:
            rank.proc.stdin.write("run\n")
            rank.proc.stdin.flush()
        results = [json.loads(rank.proc.stdout.readline()) for rank in self.ranks]
        return results[0]

    def close(self) -> None:
        for rank in self.ranks:
            rank.close()


class Baseline:
    """Single-process mlx-lm kept loaded in a subprocess, one run per request (`script`:
    what it runs, given the model, the tokens, the prompt and `extra`)."""

    def __init__(
        self,
        path: Path,
        tokens: int,
        prompt: str,
        env: dict[str, str],
        script: str = BASELINE,
        extra: tuple[str, ...] = (),
        wait: bool = True,
    ) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script, str(path), str(tokens), prompt, *extra],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
        )
        self.prompt_tokens = 0
        if wait:  # (`wait=False`: one of several that load together; `started` later)
            self.started()

    def started(self) -> None:
        """Wait for the loaded process's first line."""
        self.prompt_tokens = json.loads(self.proc.stdout.readline())["prompt_tokens"]

    def run(self) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


# The machine's cores, read before this process pins itself to core 0 (main): read
# after, every rank would be given core 0.
MACHINE_CORES = sorted(os.sched_getaffinity(0))


def core_set(rank: int, per_rank: int) -> list[int]:
    """Rank r's cores: the r-th run of `per_rank` cores, wrapping round the machine."""
    cores = MACHINE_CORES
    return [cores[(rank * per_rank + i) % len(cores)] for i in range(per_rank)]


def pin_all_threads(pid: int, cores: list[int]) -> list[int]:
    """Pin every thread of a running process (MLX's stream and ring threads included:
    `sched_setaffinity` on the pid alone moves only the main thread); returns the cores
    its threads are on, read back, for the run's log."""
    on: set[int] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
            on |= os.sched_getaffinity(int(tid))
        except ProcessLookupError:  # (a thread that ended since the listing)
            continue
    return sorted(on)


def cpu_seconds(pids: list[int]) -> list[float]:
    """Each process's CPU time so far (user + system, all its threads)."""
    return [sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids]


def client_cores(ranks: int, per_rank: int, where: str) -> list[int]:
    """The cores this process (the client) runs on for a cluster of `ranks`: rank 0's
    first, or with `where` "free" the cores none of its ranks has, if there are any."""
    if where == "free":
        used = {c for r in range(ranks) for c in core_set(r, per_rank)}
        free = [c for c in MACHINE_CORES if c not in used]
        if free:
            return free
    return [core_set(0, per_rank)[0]]


def on_cores(cores: list[int], run: Callable[[], dict]) -> Callable[[], dict]:
    """`run` with every thread of this process (the client's gRPC threads too) on `cores`."""

    def pinned() -> dict:
        pin_all_threads(os.getpid(), cores)
        return run()

    return pinned


def accounted(run: Callable[[], dict], pids: list[int], tokens: int) -> Callable[[], dict]:
    """`run`, also reporting the CPU ms per token of each of `pids` and of this process
    (the client), and the run's wall ms per token."""

    def measured() -> dict:
        before, t0 = cpu_seconds([*pids, os.getpid()]), time.perf_counter()
        result = run()
        wall = time.perf_counter() - t0
        after = cpu_seconds([*pids, os.getpid()])
        per_token = [(b - a) * 1000 / tokens for a, b in zip(before, after, strict=True)]
        return {**result, "cpu_ms": per_token, "wall_ms": wall * 1000 / tokens}

    return measured


def gpu_env(rank: int, gpus: int) -> dict[str, str]:
    """Rank r's GPU: r mod `gpus`, or the (r mod `gpus`)th of MLX_RELAY_BENCH_GPU_ORDER
    (e.g. "1,0"), which tells a GPU's own speed from the work of the rank it runs."""
    if not gpus:
        return {}
    order = os.environ.get("MLX_RELAY_BENCH_GPU_ORDER")
    ids = [int(x) for x in order.split(",")] if order else list(range(gpus))
    return {"CUDA_VISIBLE_DEVICES": str(ids[rank % gpus])}


def interleaved(runners: dict[str, Callable[[], dict]], rounds: int) -> dict[str, list[dict]]:
    """Every runner's results over `rounds` rounds, the runners taking turns in each,
    after two warm-up rounds: a cluster's first prompt after its load goes in a short
    probe chunk (coordinator/policy.py), so the second is the first to take the chunk
    shapes every later round takes, whose kernels (on a GPU) compile then."""
    for _ in range(2):
        for run in runners.values():
            run()
    results: dict[str, list[dict]] = {label: [] for label in runners}
    for i in range(rounds):
        for label, run in runners.items():
            results[label].append(run())
        print(f"round {i + 1}/{rounds} done", file=sys.stderr)
    return results


def cluster_run(client: Client, tokens: int, prompt: str) -> dict:
    request = pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content=prompt)],
        params=pb.SamplingParams(max_tokens=tokens, ignore_eos=True),
    )
    t0 = time.perf_counter()
    first = None
    count = 0
    for chunk in client.stream(request):
        count += len(chunk.token_ids)
        if first is None and chunk.token_ids:
            first = time.perf_counter()
    end = time.perf_counter()
    return {"ttft": first - t0, "decode_tps": (count - 1) / (end - first)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ranks", default="1,2,3")
    ap.add_argument("--shape", choices=shapes.NAMES, help="a random-weight model of this shape")
    ap.add_argument("--gpus", type=int, default=0, help="CUDA: rank r runs on GPU r mod G")
    ap.add_argument("--serve-args", default="", help="extra options for every cluster")
    ap.add_argument(
        "--hop-modes",
        default="auto",
        help="comma-separated --hop-mode values: each multi-rank size runs once per mode",
    )
    ap.add_argument(
        "--layouts",
        default="pipeline",
        help="comma-separated: pipeline (a layer range a rank), tensor (--tensor-parallel N: "
        "every layer split across the N ranks), auto (--tensor-parallel auto: the load "
        "measures and chooses; its figures go to stderr), mlx-lm-tensor (mlx-lm's own sharded_load "
        "generation on N processes, a reference); each multi-rank size runs once per layout",
    )
    ap.add_argument("--prompt-tokens", type=int, default=0, help="lengthen the prompt to about N")
    ap.add_argument(
        "--client-core",
        choices=("rank0", "free"),
        default="rank0",
        help="CPU: where this benchmark's gRPC client runs: on rank 0's core (a client on "
        "the coordinator's machine, sharing its core), or on a core no rank of the "
        "configuration uses where there is one (a client of its own, as mlx-lm's baseline "
        "has none), else rank 0's",
    )
    ap.add_argument(
        "--cores-per-rank",
        type=int,
        default=1,
        help="CPU: each rank (and the baseline) gets this many cores of its own, a machine's "
        "share; 0: nothing pinned",
    )
    args = ap.parse_args()
    per_rank = args.cores_per_rank if args.gpus == 0 else 0
    if per_rank:
        os.sched_setaffinity(0, {core_set(0, per_rank)[0]})  # see the module docstring

    from mlx_relay.model.default_model import resolve_model

    if args.shape:
        args.model = str(shapes.make_shape(args.shape, shapes.cache_dir() / args.shape))
    path = resolve_model(args.model)
    sizes = [int(x) for x in args.ranks.split(",")]
    print(f"model {path}  tokens {args.tokens}  rounds {args.rounds}  cores {os.cpu_count()}")
    with contextlib.ExitStack() as stack:
        runners: dict[str, Callable[[], dict]] = {}
        prompt = make_prompt(args.prompt_tokens)
        base = Baseline(
            path,
            args.tokens,
            prompt,
            gpu_env(0, args.gpus)
            or ({"BENCH_CORES": ",".join(map(str, core_set(0, per_rank)))} if per_rank else {}),
        )
        stack.callback(base.close)
        runners["mlx_lm (1 process)"] = accounted(base.run, [base.proc.pid], args.tokens)
        modes = args.hop_modes.split(",")
        layouts = args.layouts.split(",")
        configs = [
            (n, mode, layout)
            for n in sizes
            for layout in (layouts if n > 1 else ["pipeline"])
            for mode in (modes if n > 1 and layout in ("pipeline", "auto") else ["auto"])
        ]
        for n in sizes if "mlx-lm-tensor" in layouts else ():
            if n > 1:
                sharded = ShardedBaseline(path, args.tokens, prompt, n, args.gpus)
                stack.callback(sharded.close)
                runners[f"mlx_lm TP{n} ({n} processes)"] = accounted(
                    sharded.run, [r.proc.pid for r in sharded.ranks], args.tokens
                )
        configs = [c for c in configs if c[2] != "mlx-lm-tensor"]
        for n, mode, layout in configs:  # every cluster stays up, idle between turns
            address = f"127.0.0.1:{free_ports(1)[0]}"
            logs = Path(tempfile.mkdtemp(prefix="bench-logs-"))
            cluster = stack.enter_context(
                LocalCluster(
                    n,
                    [
                        *("--model", args.model, "--no-prompt-cache", "--hop-mode", mode),
                        *(("--tensor-parallel", str(n)) if layout == "tensor" else ()),
                        *(("--tensor-parallel", "auto") if layout == "auto" else ()),
                        *args.serve_args.split(),
                    ],
                    grpc_address=address,
                    log_dir=logs,
                    rank_env={r: gpu_env(r, args.gpus) for r in range(n)},
                )
            )
            cluster.wait_serving(600)
            client = stack.enter_context(Client(address, timeout=600))
            label = f"mlx-relay {n} rank{'s' if n > 1 else ''}"
            label += (
                f" {mode}" if len(modes) > 1 and n > 1 and layout in ("pipeline", "auto") else ""
            )
            label += f" TP{n}" if layout == "tensor" else ""
            if layout == "auto":  # (what the load measured and chose)
                chosen = client.status().layout
                label += f" auto:TP{n}" if chosen.tensor_parallel > 1 else " auto:PP"
                print(f"{label}: {chosen.note}", file=sys.stderr)
            for rank, proc in enumerate(cluster.procs if per_rank else []):
                on = pin_all_threads(proc.pid, core_set(rank, per_rank))
                print(f"{label}: rank {rank}'s threads on core(s) {on}", file=sys.stderr)
            run = accounted(
                lambda c=client: cluster_run(c, args.tokens, prompt),
                [p.pid for p in cluster.procs],
                args.tokens,
            )
            if per_rank:
                cores = client_cores(n, per_rank, args.client_core)
                print(f"{label}: the client on core(s) {cores}", file=sys.stderr)
                run = on_cores(cores, run)
            runners[label] = run
        results = interleaved(runners, args.rounds)
    print(f"prompt {base.prompt_tokens} tokens; median of {args.rounds} interleaved rounds")
    print(f"{'config':<28}{'decode tok/s':>14}{'ratio':>8}{'TTFT ms':>10}{'ratio':>8}")
    reference = results["mlx_lm (1 process)"]
    for label, runs in results.items():
        # Ratios are taken within a round (runs seconds apart), then the median over rounds.
        tps = statistics.median(r["decode_tps"] for r in runs)
        ttft = statistics.median(r["ttft"] for r in runs)
        tps_ratio = statistics.median(
            r["decode_tps"] / b["decode_tps"] for r, b in zip(runs, reference, strict=True)
        )
        ttft_ratio = statistics.median(
            r["ttft"] / b["ttft"] for r, b in zip(runs, reference, strict=True)
        )
        print(f"{label:<28}{tps:>14.2f}{tps_ratio:>8.3f}{ttft * 1000:>10.1f}{ttft_ratio:>8.3f}")
    print("decode ratio to mlx_lm, round by round:")
    for label, runs in results.items():
        ratios = [r["decode_tps"] / b["decode_tps"] for r, b in zip(runs, reference, strict=True)]
        print(f"  {label:<28}" + " ".join(f"{x:.3f}" for x in ratios))
    print_cpu(results)
    return 0


def print_cpu(results: dict[str, list[dict]]) -> None:
    """Medians over rounds of each process's CPU ms per generated token (prefill included)."""
    print("CPU ms per token (user + system; the baseline's process, else ranks 0.. then the")
    print("client), and wall ms per token of the same runs, medians over rounds:")
    for label, runs in results.items():
        columns = zip(*(r["cpu_ms"] for r in runs), strict=True)
        cpu = [statistics.median(c) for c in columns]
        if label.startswith("mlx_lm"):
            cpu = cpu[:1]  # (this process only waits on the baseline's pipe)
        wall = statistics.median(r["wall_ms"] for r in runs)
        shown = " ".join(f"{c:6.2f}" for c in cpu)
        print(f"  {label:<28}{shown}   total {sum(cpu):6.2f}   wall {wall:6.2f}")


if __name__ == "__main__":
    sys.exit(main())
