"""Rank processes forked from a process that has already imported the heavy libraries.

Most of a rank's start is imports, and most of those are transformers: mlx-lm's package
imports it for its tokenizers, worker ranks included, and transformers 5 reads about
3,400 of its own source files on every import (measured on the 2-core test machine: 1.3
of a worker's 1.5 CPU-seconds to start). `mlx-relay local` starts every rank on one
machine, and starts them again after a failure; so on Linux it asks a zygote, one
process per launcher that imports those libraries once and forks a child for each rank.
The child then runs `python -m MODULE ARGS` as a fresh interpreter would (`runpy`, the
same argv, environment, working directory, inherited descriptors and output pipe, its own
session, SIGTERM when its parent dies), and ends through the interpreter's own exit.

What may be imported before a fork is narrow on purpose: libraries that start no thread
and touch no device. Not mlx (CUDA and Metal must never be initialised in a process that
forks), not gRPC (its fork handlers), not mlx-relay's own modules (they read their
environment variables when imported, and each rank has its own). macOS keeps plain
spawns: there, a forked child that did not exec may not use the system frameworks its
parent loaded. `MLX_RELAY_ZYGOTE=0` turns the zygote off anywhere.

The zygote ends when its launcher does (its socket reads end-of-file), and its children
then get SIGTERM (their parent-death signal), as ranks started by the launcher would.
The launcher learns each child's pid and exit status over the socket; `ForkedProcess`
answers like `subprocess.Popen` (`poll`, `wait`, `send_signal`, `returncode`, `stdout`).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import importlib.util
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import IO, Any

log = logging.getLogger("mlx_relay.zygote")

ZYGOTE_ENV = "MLX_RELAY_ZYGOTE"

# Imported once in the zygote: what mlx-lm's package imports that is neither mlx nor
# mlx-lm (the attributes force transformers' lazy module to load what mlx-lm takes), then
# the other libraries every rank imports that start no thread when imported (a rank 0
# with HTTP doors: FastAPI and uvicorn, 0.65 CPU-seconds of a start on the 2-core test
# machine; the rest ~0.2 s a rank).
_PRELOAD = (
    "transformers",
    "transformers.tokenization_utils_base",
    "huggingface_hub",
    "google.protobuf.json_format",
    "jsonschema",
    "llguidance",
    "prometheus_client",
    "psutil",
    "zmq",
    "fastapi",
    "uvicorn",
)
_PRELOAD_ATTRS = (
    ("transformers", "AutoTokenizer"),
    ("transformers", "PreTrainedTokenizerFast"),
    ("huggingface_hub", "snapshot_download"),
)
# Where PyTorch is installed, transformers' tokenizer classes import it, and it starts a
# thread: on the 2x H200 host (torch in its system Python) `transformers.AutoTokenizer`
# started `jemalloc_bg_thd` and the zygote refused to fork. There those attributes are
# left for each rank to load (the modules above stay preloaded), so the zygote still forks.
_TORCH = "torch"
_MAX_MESSAGE = 1 << 20
_MAX_FDS = 16


def enabled() -> bool:
    """Whether `local` forks ranks from a zygote here: Linux, unless MLX_RELAY_ZYGOTE=0."""
    return sys.platform == "linux" and os.environ.get(ZYGOTE_ENV, "1") != "0"


class ZygoteError(RuntimeError):
    """The zygote could not start or fork a child."""


class ForkedProcess:
    """A child of the zygote, seen from the launcher as a `subprocess.Popen` is."""

    def __init__(self, args: list[str], pid: int) -> None:
        self.args = args
        self.pid = pid
        self.stdout: IO[bytes] | None = None  # (the launcher's end of the output pipe)
        self.returncode: int | None = None
        self._ended = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # (as Popen: never signal a pid that may be reused)
            # (the zygote reaps its children: one that exited since our last look is
            # gone already, with nothing left to signal)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The launcher's end: starts the zygote process, asks it for children, hears them end."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OPENBLAS_NUM_THREADS": "1"}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(theirs.fileno())],
            env=env,
            stdin=subprocess.DEVNULL,
            pass_fds=(theirs.fileno(),),
            start_new_session=True,  # Ctrl-C reaches the launcher, which stops ranks in order
        )
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()  # one fork request at a time
        self._children: dict[int, ForkedProcess] = {}
        self._replies: list[dict[str, Any]] = []
        self._replied = threading.Condition()
        self.alive = True
        said = self._read()
        if said.get("ready") is not True:
            self._sock.close()
            self._proc.wait()
            raise ZygoteError(f"the zygote did not start: {said.get('error', 'it exited')}")
        threading.Thread(target=self._hear, name="zygote", daemon=True).start()

    def spawn(
        self,
        module: str,
        args: list[str],
        *,
        env: dict[str, str],
        pass_fds: tuple[int, ...] = (),
        cpu: int | None = None,
    ) -> ForkedProcess:
        """`python -m module args` in a forked child, its stdout and stderr on a pipe."""
        read, write = os.pipe()
        job = {
            "module": module,
            "args": args,
            "env": env,
            "cwd": os.getcwd(),
            "keep": list(pass_fds),
            "cpu": cpu,
        }
        try:
            with self._lock, self._replied:
                socket.send_fds(self._sock, [json.dumps(job).encode()], [write, *pass_fds])
                while not self._replies and self.alive:
                    self._replied.wait()
                reply = self._replies.pop(0) if self._replies else {"error": "the zygote ended"}
        except OSError as e:
            reply = {"error": str(e)}
        finally:
            os.close(write)
        if "pid" not in reply:
            os.close(read)
            raise ZygoteError(f"could not fork a rank: {reply.get('error')}")
        process: ForkedProcess = reply["process"]
        process.stdout = os.fdopen(read, "rb")
        return process

    def _hear(self) -> None:
        """Replies to fork requests, and children's exit statuses, as they come."""
        while True:
            try:
                message = self._read()
            except (OSError, ValueError):
                message = {}
            if not message:
                break
            if "exit" in message:
                self._children.pop(message["exit"])._exited(message["code"])
                continue
            if "pid" in message:  # (registered here, before its exit can be read)
                process = ForkedProcess(message["args"], message["pid"])
                self._children[message["pid"]] = message["process"] = process
            with self._replied:
                self._replies.append(message)
                self._replied.notify_all()
        self.alive = False
        for process in self._children.values():  # their parent is gone, and so are they
            process._exited(-signal.SIGTERM)
        with self._replied:
            self._replied.notify_all()

    def _read(self) -> dict[str, Any]:
        data = self._sock.recv(_MAX_MESSAGE)
        return json.loads(data) if data else {}

    def close(self) -> None:
        """End the zygote (its children, if any, get SIGTERM)."""
        try:  # (shutdown, not only close: that wakes the reading thread and ends the socket)
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._proc.wait()


_shared: Zygote | None = None
_shared_lock = threading.Lock()


def shared() -> Zygote | None:
    """This process's zygote, started on first use (and again if it ended); None where
    it is off or cannot start (the launcher then spawns its ranks as before)."""
    global _shared
    if not enabled():
        return None
    with _shared_lock:
        if _shared is None or not _shared.alive:
            try:
                _shared = Zygote()
            except (OSError, ZygoteError) as e:
                log.warning("ranks start without a zygote: %s", e)
                return None
        return _shared


# --- the zygote process ---------------------------------------------------------------


@dataclass
class _Job:
    module: str
    args: list[str]


def _preload() -> None:
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # (as mlx-lm sets it)
    for name in _PRELOAD:
        importlib.import_module(name)
    for name, attr in _attributes_to_preload():
        getattr(sys.modules[name], attr)
    if "mlx" in sys.modules or "grpc" in sys.modules:  # a library changed what it imports
        raise ZygoteError("a preloaded library imported mlx or grpc: forking would be unsafe")
    others = _other_threads()
    if others:
        raise ZygoteError(
            f"a preloaded library started {len(others)} thread(s) ({', '.join(others)}): "
            f"forking would be unsafe"
        )


def _attributes_to_preload() -> tuple[tuple[str, str], ...]:
    """_PRELOAD_ATTRS, less transformers' where PyTorch is installed (see _TORCH)."""
    if importlib.util.find_spec(_TORCH) is None:
        return _PRELOAD_ATTRS
    return tuple(item for item in _PRELOAD_ATTRS if item[0] != "transformers")


def _other_threads() -> list[str]:
    """The names of this process's threads but the calling one (Linux's /proc: threads
    that native libraries started are counted too), so a refusal says whose they are."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != threading.get_native_id():
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    names.append(f.read().strip())
            except FileNotFoundError:  # (a thread that ended since the listing)
                continue
    return names


def _serve(sock: socket.socket) -> _Job:
    """Fork a child for each request until the launcher is gone; return only in a child."""
    children: dict[int, int] = {}  # pidfd -> pid
    while True:
        ready, _, _ = select.select([sock, *children], [], [])
        for fd in ready:
            if fd is not sock:
                pid = children.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                sock.send(
                    json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode()
                )
                continue
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, _MAX_FDS)
            if not data:
                os._exit(0)  # the launcher is gone; the children's parent-death signal follows
            job = json.loads(data)
            parent = os.getpid()
            try:
                pid = os.fork()
            except OSError as e:
                for f in fds:
                    os.close(f)
                sock.send(json.dumps({"error": str(e)}).encode())
                continue
            if pid == 0:
                sock.close()
                for f in children:
                    os.close(f)
                _become(job, fds, parent)
                return _Job(job["module"], job["args"])
            for f in fds:
                os.close(f)
            children[os.pidfd_open(pid)] = pid
            argv = [sys.executable, "-m", job["module"], *job["args"]]
            sock.send(json.dumps({"pid": pid, "args": argv}).encode())


def _become(job: dict[str, Any], fds: list[int], parent: int) -> None:
    """In the child: what Popen and lifeline.child_setup would have given it."""
    from mlx_relay.launch.lifeline import set_parent_death_signal

    os.setsid()  # Ctrl-C in the terminal reaches the launcher only
    set_parent_death_signal(parent)
    if job["cpu"] is not None:
        os.sched_setaffinity(0, {job["cpu"]})
    os.chdir(job["cwd"])
    # Received descriptors move above every number they must land on, then land there.
    floor = max([2, *job["keep"]]) + 1
    high = [fcntl.fcntl(f, fcntl.F_DUPFD_CLOEXEC, floor) for f in fds]
    for f in fds:
        os.close(f)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(high[0], 1)
    os.dup2(high[0], 2)
    for f, number in zip(high[1:], job["keep"], strict=True):
        os.dup2(f, number)  # inheritable, as Popen's pass_fds
    for f in high:
        os.close(f)
    # setproctitle finds the command line's room beside the environment block the process
    # started with: let it find that before the environment is replaced, so that the rank
    # can name itself in ps later (mlx_relay/proctitle.py).
    import setproctitle

    setproctitle.setproctitle(setproctitle.getproctitle())
    os.environ.clear()
    os.environ.update(job["env"])
    # The search path a fresh `python -m` would have here: its directory, then PYTHONPATH.
    extra = [p for p in job["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:1] = [job["cwd"], *(p for p in extra if p not in sys.path)]
    import tempfile

    tempfile.tempdir = None  # (chosen again from this environment's TMPDIR)


def _run(job: _Job) -> None:
    import runpy

    sys.argv = [job.module, *job.args]
    runpy.run_module(job.module, run_name="__main__", alter_sys=True)


def main(argv: list[str]) -> None:
    sock = socket.socket(fileno=int(argv[0]))
    try:
        _preload()
    except Exception as e:  # noqa: BLE001 - the launcher falls back to plain spawns
        sock.send(json.dumps({"error": str(e)}).encode())
        raise SystemExit(1) from e
    sock.send(json.dumps({"ready": True}).encode())
    _run(_serve(sock))


if __name__ == "__main__":
    main(sys.argv[1:])
