"""`mlx-relay local`: a whole cluster on this machine, one process per rank.

Ranks talk over the ring backend on loopback (fresh free ports every time: the ring
backend sets SO_REUSEPORT, so two clusters on the same ports could wire into each
other). The launcher stays in the foreground, waits until the cluster serves, and on
Ctrl-C or SIGTERM asks rank 0 to shut every rank down, leaving no process behind.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from mlx_relay.doorbell import DOORBELLS_ENV
from mlx_relay.launch.serve import DEFAULT_GRPC_ADDRESS, add_serve_options
from mlx_relay.launch.supervise import EXIT_RANK_FAILED, describe_exit
from mlx_relay.protocol import control


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class LocalCluster:
    """N rank processes on loopback. Usable from tests and benchmarks as well as the CLI."""

    n: int
    serve_args: list[str]
    grpc_address: str = DEFAULT_GRPC_ADDRESS
    log_dir: Path | None = None
    pin: bool = False
    env: dict[str, str] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)

    def start(self) -> LocalCluster:
        workdir = Path(tempfile.mkdtemp(prefix="mlx-relay-"))
        ports = free_ports(2 * self.n + 1)
        hostfile = workdir / "hostfile.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports[: self.n]]))
        base_env = {
            **os.environ,
            **self.env,
            control.SECRET_ENV: control.new_secret(),
            control.CONTROL_ENV: f"tcp://127.0.0.1:{ports[self.n]}",
            DOORBELLS_ENV: json.dumps([f"tcp://127.0.0.1:{p}" for p in ports[self.n + 1 :]]),
            "PYTHONUNBUFFERED": "1",
        }
        cmd = [sys.executable, "-m", "mlx_relay", "serve", *self.serve_args]
        cmd += ["--grpc-address", self.grpc_address]
        for rank in range(self.n):
            env = dict(base_env)
            if self.n > 1:
                env.update(MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile))
            out = None
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                out = open(self.log_dir / f"rank{rank}.log", "ab")  # noqa: SIM115
            self.procs.append(
                subprocess.Popen(
                    cmd,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT if out else None,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # Ctrl-C reaches the launcher, which stops ranks in order
                    preexec_fn=_pin_to_core(rank) if self.pin else None,
                )
            )
            if out is not None:
                out.close()
        return self

    def failed_rank(self) -> tuple[int, int] | None:
        """The first rank that exited abnormally, with its return code."""
        for rank, p in enumerate(self.procs):
            code = p.poll()
            if code is not None and code != 0:
                return rank, code
        return None

    def wait_serving(self, timeout: float = 300.0) -> None:
        from mlx_relay.coordinator.client import wait_serving

        def check() -> None:
            failed = self.failed_rank()
            if failed:
                rank, code = failed
                raise RuntimeError(f"rank {rank} {describe_exit(code)} before the cluster served")

        wait_serving(self.grpc_address, timeout, check=check)

    def stop(self, timeout: float = 30.0) -> list[int | None]:
        """SIGTERM rank 0 (it shuts the ring down with CMD_SHUTDOWN); kill what remains."""
        if self.procs and self.procs[0].poll() is None:
            self.procs[0].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        return [p.returncode for p in self.procs]

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _pin_to_core(rank: int):
    cores = sorted(os.sched_getaffinity(0))

    def pin() -> None:
        os.sched_setaffinity(0, {cores[rank % len(cores)]})

    return pin


def serve_args_from(args: argparse.Namespace) -> list[str]:
    out = ["--model", args.model]
    if args.layers:
        out += ["--layers", args.layers]
    out += ["--max-active", str(args.max_active), "--max-queue", str(args.max_queue)]
    out += ["--prefill-chunk", str(args.prefill_chunk)]
    out += ["--default-max-tokens", str(args.default_max_tokens)]
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("local", help="start an N-rank cluster on this machine and serve it")
    p.add_argument("-n", "--num-ranks", type=int, default=2, help="number of ranks")
    add_serve_options(p)
    p.add_argument("--pin", action="store_true", help="pin each rank to its own core")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.num_ranks < 1:
        print("mlx-relay local: -n must be at least 1", file=sys.stderr)
        return 2
    cluster = LocalCluster(
        args.num_ranks, serve_args_from(args), grpc_address=args.grpc_address, pin=args.pin
    )
    stopping = False

    def on_signal(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    cluster.start()
    try:
        cluster.wait_serving(args.startup_timeout)
    except Exception as e:  # noqa: BLE001
        if not stopping:
            print(f"mlx-relay local: {e}", file=sys.stderr)
            cluster.stop()
            return EXIT_RANK_FAILED
    if not stopping:
        print(
            f"mlx-relay: {args.num_ranks} rank(s) serving {args.model} on {args.grpc_address} "
            "(Ctrl-C to stop)",
            file=sys.stderr,
            flush=True,
        )
    while not stopping:
        failed = cluster.failed_rank()
        if failed:
            rank, code = failed
            print(
                f"mlx-relay local: rank {rank} {describe_exit(code)}; stopping the cluster",
                file=sys.stderr,
            )
            cluster.stop()
            return EXIT_RANK_FAILED
        if all(p.poll() == 0 for p in cluster.procs):
            return 0  # shut down through Free(shutdown=true)
        time.sleep(0.2)
    codes = cluster.stop()
    bad = [(r, c) for r, c in enumerate(codes) if c != 0]
    for rank, code in bad:
        print(f"mlx-relay local: rank {rank} {describe_exit(code)}", file=sys.stderr)
    return EXIT_RANK_FAILED if bad else 0
