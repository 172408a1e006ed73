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
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mlx_relay.coordinator.auth import AUTH_TOKEN_ENV, auth_token
from mlx_relay.doorbell import DOORBELLS_ENV
from mlx_relay.launch.serve import DEFAULT_GRPC_ADDRESS, add_serve_options
from mlx_relay.launch.supervise import Supervisor, run_with_restarts
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
    """N rank processes on loopback. Usable from tests and benchmarks as well as the CLI.

    `env` goes to every rank, `rank_env[r]` to rank r only (as different machines have
    different environments: HOME, memory caps). `auth_token` reaches rank 0 through
    the environment, never the command line; `tls_ca` is what this process trusts
    when it checks health over TLS.
    """

    n: int
    serve_args: list[str]
    grpc_address: str = DEFAULT_GRPC_ADDRESS
    log_dir: Path | None = None
    pin: bool = False
    env: dict[str, str] = field(default_factory=dict)
    rank_env: dict[int, dict[str, str]] = field(default_factory=dict)
    auth_token: str = ""
    tls_ca: str | None = None
    procs: list[subprocess.Popen] = field(default_factory=list)
    control_endpoint: str = ""

    def start(self) -> LocalCluster:
        self.procs = []
        workdir = Path(tempfile.mkdtemp(prefix="mlx-relay-"))
        ports = free_ports(2 * self.n + 1)
        hostfile = workdir / "hostfile.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports[: self.n]]))
        self.control_endpoint = f"tcp://127.0.0.1:{ports[self.n]}"
        base_env = {
            **os.environ,
            **self.env,
            control.SECRET_ENV: control.new_secret(),
            control.CONTROL_ENV: self.control_endpoint,
            DOORBELLS_ENV: json.dumps([f"tcp://127.0.0.1:{p}" for p in ports[self.n + 1 :]]),
            "PYTHONUNBUFFERED": "1",
        }
        if self.auth_token:
            base_env[AUTH_TOKEN_ENV] = self.auth_token
        cmd = [sys.executable, "-m", "mlx_relay", "serve", *self.serve_args]
        cmd += ["--grpc-address", self.grpc_address]
        for rank in range(self.n):
            env = {**base_env, **self.rank_env.get(rank, {})}
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
        self.supervisor = Supervisor(self.procs, ["127.0.0.1"] * self.n)
        return self

    def failed_rank(self) -> tuple[int, int] | None:
        """The first rank that exited abnormally, with its return code."""
        failure = self.supervisor.first_failure() if self.procs else None
        return (failure.rank, failure.code) if failure else None

    def wait_serving(
        self, timeout: float = 300.0, give_up: Callable[[], bool] = lambda: False
    ) -> None:
        from mlx_relay.coordinator.client import wait_serving

        def check() -> None:
            failure = self.supervisor.first_failure()
            if failure:
                raise RuntimeError(f"{failure} before the cluster served")
            if give_up():
                raise InterruptedError("stopped before the cluster served")

        wait_serving(
            self.grpc_address, timeout, check=check, token=self.auth_token, tls_ca=self.tls_ca
        )

    def stop(self, timeout: float = 30.0) -> list[int | None]:
        """SIGTERM rank 0 (it drains, then shuts the ring down); then the rest; then kill."""
        if not self.procs:
            return []
        return self.supervisor.stop(timeout)

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
    if args.no_prompt_cache:
        out += ["--no-prompt-cache"]
    out += ["--prompt-cache-tokens", str(args.prompt_cache_tokens)]
    out += ["--heartbeat-timeout", str(args.heartbeat_timeout)]
    out += ["--step-timeout", str(args.step_timeout)]
    out += ["--drain-timeout", str(args.drain_timeout)]
    out += ["--max-request-bytes", str(args.max_request_bytes)]
    if args.tls_cert or args.tls_key:
        out += ["--tls-cert", args.tls_cert, "--tls-key", args.tls_key]
    return out  # the auth token travels in the environment, not on command lines


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("local", help="start an N-rank cluster on this machine and serve it")
    p.add_argument("-n", "--num-ranks", type=int, default=2, help="number of ranks")
    add_serve_options(p)
    p.add_argument("--pin", action="store_true", help="pin each rank to its own core")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument(
        "--restart",
        type=int,
        default=0,
        metavar="N",
        help="after a rank fails, stop the others and start the cluster again, up to N times",
    )
    p.add_argument(
        "--tls-ca", default=None, help="PEM to verify rank 0's TLS with (default: --tls-cert)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.num_ranks < 1:
        print("mlx-relay local: -n must be at least 1", file=sys.stderr)
        return 2
    token = auth_token(args.auth_token)
    cluster = LocalCluster(
        args.num_ranks,
        serve_args_from(args),
        grpc_address=args.grpc_address,
        pin=args.pin,
        auth_token=token,
        tls_ca=args.tls_ca or args.tls_cert or None,
    )
    stopping = threading.Event()

    def on_signal(*_: object) -> None:
        stopping.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    def report(message: str) -> None:
        print(f"mlx-relay local: {message}", file=sys.stderr, flush=True)

    def start() -> Supervisor:
        return cluster.start().supervisor

    def ready(_: Supervisor) -> None:
        cluster.wait_serving(args.startup_timeout, give_up=stopping.is_set)
        report(
            f"{args.num_ranks} rank(s) serving {args.model} on {args.grpc_address} (Ctrl-C to stop)"
        )

    return run_with_restarts(
        start,
        args.restart,
        ready=ready,
        stop_event=stopping,
        report=report,
        stop_timeout=args.drain_timeout + 30,
    )
