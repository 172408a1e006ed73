"""`mlx-relay local`: a whole cluster on this machine, one process per rank.

Ranks talk over the ring backend on loopback (fresh free ports every time: the ring
backend sets SO_REUSEPORT, so two clusters on the same ports could wire into each
other). The launcher checks the model and the split first (`preflight`), starts the
ranks, stays in the foreground, and waits until the cluster serves; a rank that fails
ends the start at once, with its cause. On Ctrl-C, SIGTERM or SIGHUP it asks rank 0 to
shut every rank down; if the launcher dies any other way (kill -9), its ranks get SIGTERM
(`lifeline`). Either way no process or temporary file is left behind.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from mlx_relay.errors import UserError, add_log_level
from mlx_relay.launch import preflight, zygote
from mlx_relay.launch.lifeline import Lifeline, child_setup
from mlx_relay.launch.serve import add_serve_options, serve_argv
from mlx_relay.launch.supervise import (
    LastWords,
    RankChild,
    RankFailed,
    Supervisor,
    add_restarts,
    add_startup_timeout,
    run_with_restarts,
)
from mlx_relay.protocol import control
from mlx_relay.protocol.rpc import AUTH_TOKEN_ENV, DEFAULT_GRPC_ADDRESS, auth_token
from mlx_relay.transport.doorbell import DOORBELLS_ENV

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PORT = 20000  # above the registered services people run on a Mac (5000, 7000, 8080)
_handed_out: set[int] = set()
_pick = random.SystemRandom()


def ephemeral_port_start() -> int:
    """Where the kernel's own port choices begin (Linux reads it, macOS and IANA: 49152)."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


PORTS_ENV = "MLX_RELAY_PORTS"


def port_range() -> tuple[int, int]:
    """The ports [low, high) that local clusters pick from: `MLX_RELAY_PORTS=LOW-HIGH`
    where it is set (a firewall's open range; two runs on one machine that must never
    pick the same port, as test workers side by side), else 20000 up to where the
    kernel's ephemeral range begins."""
    spec = os.environ.get(PORTS_ENV, "").strip()
    if not spec:
        return _LOWEST_PORT, ephemeral_port_start()
    try:
        low, high = (int(part) for part in spec.split("-"))
    except ValueError:
        raise UserError(f"{PORTS_ENV}={spec!r}: expected LOW-HIGH, e.g. 20000-26000") from None
    if not 1024 < low < high <= 65536:
        raise UserError(f"{PORTS_ENV}={spec!r}: expected 1024 < LOW < HIGH <= 65536")
    return low, high


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports that bind now.

    They are chosen below the kernel's ephemeral range: a port the kernel picked (bind to
    port 0) is free only until the next outgoing connection, whose source port comes from
    that same range, and clusters open many (ring, side channel, doorbells, clients); CI
    once lost a test to exactly that race. No port is handed out twice by one process
    (processes side by side keep apart with `MLX_RELAY_PORTS`: `port_range`).
    """
    low, high = port_range()
    if high - low < 1000 and PORTS_ENV not in os.environ:  # a wide ephemeral range
        return _kernel_ports(n)
    ports: list[int] = []
    for _ in range(50 * n):
        port = _pick.randrange(low, high)
        if port in _handed_out or not _binds(port):
            continue
        _handed_out.add(port)
        ports.append(port)
        if len(ports) == n:
            return ports
    raise OSError(f"no {n} free loopback ports between {low} and {high}")


def _binds(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _kernel_ports(n: int) -> list[int]:
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

    Each rank's output (stdout and stderr, line by line) goes to `log_dir/rankN.log`,
    else to this process's stderr; on the way, a rank's last words (why it stopped)
    are kept for the failure report. The ranks die with this process however it ends
    (`lifeline`), and the temporary directory holding the ring's hostfile is removed
    once every rank has read it (when the cluster serves) or when it stops.
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
    procs: list[RankChild] = field(default_factory=list)
    control_endpoint: str = ""
    doorbell_endpoints: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._workdir: Path | None = None
        self._lifeline: Lifeline | None = None
        self._pumps: list[threading.Thread] = []
        self._output_lock = threading.Lock()
        self.last_words = LastWords()

    def start(self) -> LocalCluster:
        self._tidy()  # after a restart: what the last life of the cluster left
        self.procs = []
        self._pumps = []
        self.last_words = LastWords()
        self._lifeline = Lifeline()
        self._workdir = Path(tempfile.mkdtemp(prefix="mlx-relay-"))
        try:
            self._start_ranks(self._rank_env_base())
        except BaseException:
            self.kill()  # never leave a half-started cluster behind
            self.procs = []
            raise
        self.supervisor = Supervisor(self.procs, ["127.0.0.1"] * self.n, self.last_words)
        return self

    def _door_ports(self) -> set[int]:
        """The ports rank 0 will listen on (gRPC, HTTP, LocalAI): free now, perhaps, but
        not for the ring, side channel or doorbells, whose ranks start first. (A restarted
        cluster's door port was free again when its wiring was picked, and the ring once
        took it: rank 0 then could not listen.)"""
        addresses = [self.grpc_address]
        for flag in ("--http-address", "--localai-address"):
            if flag in self.serve_args[:-1]:
                addresses.append(self.serve_args[self.serve_args.index(flag) + 1])
        ports = set()
        for address in addresses:
            port = address.rsplit(":", 1)[-1]
            if port.isdigit():
                ports.add(int(port))
        return ports

    def _rank_env_base(self) -> dict[str, str]:
        """What every rank's environment holds: the wiring on fresh ports, the secret."""
        assert self._workdir is not None and self._lifeline is not None
        _handed_out.update(self._door_ports())  # (the wiring never takes a door's port)
        ports = free_ports(2 * self.n + 2)
        hostfile = self._workdir / "hostfile.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports[: self.n]]))
        self.control_endpoint = f"tcp://127.0.0.1:{ports[self.n]}"
        self.doorbell_endpoints = [f"tcp://127.0.0.1:{p}" for p in ports[self.n + 1 : -1]]
        env = {
            **os.environ,
            **self.env,
            **self._lifeline.env,
            control.SECRET_ENV: control.new_secret(),
            control.CONTROL_ENV: self.control_endpoint,
            DOORBELLS_ENV: json.dumps(self.doorbell_endpoints),
            "NCCL_PORT": str(ports[-1]),  # (collective hops on CUDA: NCCL's bootstrap)
            "PYTHONUNBUFFERED": "1",
        }
        if self.n > 1:
            env["MLX_HOSTFILE"] = str(hostfile)
        if self.auth_token:
            env[AUTH_TOKEN_ENV] = self.auth_token
        return env

    def _start_ranks(self, base_env: dict[str, str]) -> None:
        assert self._lifeline is not None
        cmd = [sys.executable, "-m", "mlx_relay", "serve", *self.serve_args]
        cmd += ["--grpc-address", self.grpc_address]
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        forks = zygote.shared()  # (on Linux: ranks forked with transformers imported)
        for rank in range(self.n):
            env = {**base_env, **self.rank_env.get(rank, {})}
            if self.n > 1:
                env["MLX_RANK"] = str(rank)
            proc: subprocess.Popen | zygote.ForkedProcess | None = None
            if forks is not None:
                proc = self._forked(forks, rank, cmd, env)
            if proc is None:
                proc = subprocess.Popen(
                    cmd,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    preexec_fn=self._child_setup(rank),
                    pass_fds=self._lifeline.pass_fds,
                )
            self.procs.append(proc)
            assert proc.stdout is not None
            self._pump(rank, proc.stdout)

    def _forked(
        self, forks: zygote.Zygote, rank: int, cmd: list[str], env: dict[str, str]
    ) -> zygote.ForkedProcess | None:
        """`cmd` (`python -m mlx_relay serve ...`) forked by the zygote; None if it cannot."""
        assert self._lifeline is not None
        try:
            return forks.spawn(
                "mlx_relay",
                cmd[3:],
                env=env,
                pass_fds=self._lifeline.pass_fds,
                cpu=_core_of(rank) if self.pin else None,
            )
        except zygote.ZygoteError as e:
            print(f"mlx-relay local: rank {rank} starts without the zygote: {e}", file=sys.stderr)
            return None

    def _child_setup(self, rank: int) -> Callable[[], None]:
        """Own session (Ctrl-C reaches the launcher, which stops ranks in order), death
        with the launcher, and with --pin a core of its own."""
        setup = child_setup()
        pin = _pin_to_core(rank) if self.pin else None

        def run() -> None:
            setup()
            if pin is not None:
                pin()

        return run

    def _pump(self, rank: int, stream: IO[bytes]) -> None:
        """Copy one rank's output line by line to its log (or stderr), hearing its last words."""
        stderr = getattr(sys.stderr, "buffer", sys.__stderr__.buffer)
        sink: IO[bytes] = (
            open(self.log_dir / f"rank{rank}.log", "ab")  # noqa: SIM115 - closed by the pump
            if self.log_dir is not None
            else stderr
        )
        self.last_words.opened(rank)

        def run() -> None:
            copying = True
            try:
                for line in iter(stream.readline, b""):  # to the end, so the rank never blocks
                    self.last_words.hear(line)
                    if copying:
                        copying = self._copy(sink, line)
            finally:
                stream.close()
                if sink is not stderr:
                    sink.close()
                self.last_words.closed(rank)

        thread = threading.Thread(target=run, name=f"rank{rank}-output", daemon=True)
        thread.start()
        self._pumps.append(thread)

    def _copy(self, sink: IO[bytes], line: bytes) -> bool:
        """Write one line; False once the sink is gone (a closed terminal)."""
        try:
            with self._output_lock:
                sink.write(line)
                sink.flush()
            return True
        except (OSError, ValueError):
            return False

    def failed_rank(self) -> tuple[int, int] | None:
        """The first rank that exited abnormally, with its return code."""
        failure = self.supervisor.first_failure() if self.procs else None
        return (failure.rank, failure.code) if failure else None

    def wait_serving(
        self, timeout: float = 300.0, give_up: Callable[[], bool] = lambda: False
    ) -> None:
        from mlx_relay.client.client import wait_serving

        def check() -> None:
            failure = self.supervisor.first_failure()
            if failure:
                raise RankFailed(str(failure))
            if give_up():
                raise InterruptedError("stopped before the cluster served")

        wait_serving(
            self.grpc_address, timeout, check=check, token=self.auth_token, tls_ca=self.tls_ca
        )
        self._remove_workdir()  # every rank has read the hostfile by now

    def stop(self, timeout: float = 30.0) -> list[int | None]:
        """SIGTERM rank 0 (it drains, then shuts the ring down); then the rest; then kill."""
        if not self.procs:
            self._tidy()
            return []
        codes = self.supervisor.stop(timeout)
        self._tidy()
        return codes

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
        self._tidy()

    def _tidy(self) -> None:
        """After the ranks are gone: finish copying their output, remove what we made."""
        for thread in self._pumps:
            thread.join(timeout=2)
        if self._lifeline is not None:
            self._lifeline.close()
            self._lifeline = None
        self._remove_workdir()

    def _remove_workdir(self) -> None:
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _core_of(rank: int) -> int:
    """With --pin: the core rank `rank` runs on (round robin over this process's cores)."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[rank % len(cores)]


def _pin_to_core(rank: int):
    core = _core_of(rank)

    def pin() -> None:
        os.sched_setaffinity(0, {core})

    return pin


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("local", help="start an N-rank cluster on this machine and serve it")
    p.add_argument("-n", "--num-ranks", type=int, default=2, help="number of ranks")
    add_serve_options(p)
    add_log_level(p)
    p.add_argument("--pin", action="store_true", help="pin each rank to its own core")
    add_startup_timeout(p)
    add_restarts(p)
    p.add_argument(
        "--tls-ca", default=None, help="PEM to verify rank 0's TLS with (default: --tls-cert)"
    )
    p.set_defaults(func=run)


def preflight_checks(args: argparse.Namespace) -> None:
    """What can be wrong before any rank starts: the model, the number of ranks, the
    split, TLS files, the gRPC address. Raises UserError naming the problem."""
    from mlx_relay.transport.tensor import stage_count

    if args.num_ranks < 1:
        raise UserError("-n must be at least 1")
    preflight.check_tensor_parallel(
        args.tensor_parallel, args.num_ranks, args.hop_mode, args.layers
    )
    if args.model:
        facts = preflight.check_model(args.model)
        stages = stage_count(args.tensor_parallel, args.num_ranks)  # (a grid's need layers)
        preflight.check_split(facts, stages, args.layers)
    preflight.check_hop_mode(args.hop_mode, args.num_ranks)
    preflight.check_tls(args.tls_cert, args.tls_key)
    preflight.check_listen(args.grpc_address)


def run(args: argparse.Namespace) -> int:
    preflight_checks(args)
    token = auth_token(args.auth_token)
    cluster = LocalCluster(
        args.num_ranks,
        serve_argv(args),
        grpc_address=args.grpc_address,
        pin=args.pin,
        auth_token=token,
        tls_ca=args.tls_ca or args.tls_cert or None,
    )
    stopping = threading.Event()

    def on_signal(*_: object) -> None:
        stopping.set()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: the terminal closed
        signal.signal(sig, on_signal)

    def report(message: str) -> None:
        print(f"mlx-relay local: {message}", file=sys.stderr, flush=True)

    def start() -> Supervisor:
        return cluster.start().supervisor

    def ready(_: Supervisor) -> None:
        cluster.wait_serving(args.startup_timeout, give_up=stopping.is_set)
        report(
            f"{args.num_ranks} rank(s) serving {args.model} on {args.grpc_address} (Ctrl-C to stop)"
        )

    try:
        return run_with_restarts(
            start,
            args.restarts,
            ready=ready,
            stop_event=stopping,
            report=report,
            stop_timeout=args.drain_timeout + 30,
        )
    finally:
        cluster.stop()  # already stopped: this only tidies up
