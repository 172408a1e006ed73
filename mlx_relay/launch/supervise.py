"""Supervision of a cluster's rank processes, for every launcher.

A launcher hands over one process per rank (a `Popen`, or a rank the zygote forked).
The supervisor notices the first rank that ends abnormally, says which one and how
("rank 1 (127.0.0.1) killed by SIGKILL"), and stops the rest: SIGTERM to rank 0 first
(it drains and shuts the ring down with CMD_SHUTDOWN), then SIGTERM to whatever
remains, then SIGKILL. `run_with_restarts` starts the cluster again after a failure,
up to N times.

When one rank dies, others follow on purpose (rank 0 exits EXIT_CLUSTER_FAILED after
answering its clients, workers exit EXIT_RANK0_SILENT when rank 0 goes quiet), so the
cause is the rank seen ending first; among ranks seen ending at the same poll, one
that ended for its own reasons is preferred to one that only followed.

A rank that stops for a reason it can name (a model it cannot load, a split that does
not fit) says so in one last line, `mlx-relay serve: rank N: CAUSE` (`protocol.exits.fatal_line`).
Launchers read every rank's output as it passes (`LastWords`), so the failure they
report ends with that cause, and they do not restart a cluster that would fail the
same way again (`exits.PERMANENT_EXITS`).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from mlx_relay.errors import CommandFailed
from mlx_relay.protocol import exits


class RankChild(Protocol):
    """What supervising a rank takes of its process: a `subprocess.Popen`, or a
    `zygote.ForkedProcess` (a rank `local` forked from its zygote)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


class LastWords:
    """The causes ranks gave for stopping, read from their output as launchers pass it on.

    Output arrives on reader threads, a little after the supervisor may have seen the
    process end; `cause` waits (briefly) for the process's streams to be read to the end
    so that its last line is not missed.
    """

    def __init__(self) -> None:
        self._causes: dict[int, str] = {}
        self._open: dict[int, int] = {}  # streams still being read, by process index
        self._cv = threading.Condition()

    def opened(self, proc: int) -> None:
        with self._cv:
            self._open[proc] = self._open.get(proc, 0) + 1

    def closed(self, proc: int) -> None:
        with self._cv:
            self._open[proc] -= 1
            self._cv.notify_all()

    def hear(self, line: bytes | str) -> None:
        """Look at one line of a rank's output; keep it if it is a rank's fatal line."""
        text = line.decode(errors="replace") if isinstance(line, bytes) else line
        fatal = exits.parse_fatal_line(text)
        if fatal:
            rank, cause = fatal
            with self._cv:
                self._causes.setdefault(rank, cause)

    def drained(self, wait: float = 2.0) -> bool:
        """Wait (up to `wait`) until every process's output has been read to its end, so
        that what a launcher says last comes after what its ranks said; False if some
        stream is still open then (a rank's child may hold it)."""
        with self._cv:
            return self._cv.wait_for(lambda: all(n <= 0 for n in self._open.values()), wait)

    def cause(self, rank: int, proc: int | None = None, wait: float = 2.0) -> str:
        """Rank `rank`'s cause, else the first any rank gave, else ''.

        `proc`: the index of the process whose output must be read to the end first.
        """
        proc = rank if proc is None else proc
        with self._cv:
            self._cv.wait_for(lambda: self._open.get(proc, 0) <= 0, timeout=wait)
            return self._causes.get(rank) or next(iter(self._causes.values()), "")


def add_startup_timeout(p: argparse.ArgumentParser) -> None:
    """The launchers' `--startup-timeout` (rank 0's own option of that name is another)."""
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="give up if the cluster does not serve within this many seconds (a rank "
        "that fails ends the start at once)",
    )


class _DeprecatedAlias(argparse.Action):
    """An old spelling of an option: still works, and says which one to use instead."""

    def __init__(self, option_strings: list[str], dest: str, *, new: str, **kw: object) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kw)  # type: ignore[arg-type]

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # type: ignore[no-untyped-def]
        print(
            f"{parser.prog}: warning: {option_string} is deprecated; use {self.new}",
            file=sys.stderr,
            flush=True,
        )
        setattr(namespace, self.dest, values)


def add_restarts(p: argparse.ArgumentParser) -> None:
    """Every launcher's `--restarts N` (one name everywhere; `--restart` is its old alias)."""
    p.add_argument(
        "--restarts",
        type=int,
        default=0,
        metavar="N",
        help="after a rank fails, stop the others and start the cluster again, up to N times",
    )
    p.add_argument(
        "--restart",
        dest="restarts",
        type=int,
        metavar="N",
        action=_DeprecatedAlias,
        new="--restarts",
        help=argparse.SUPPRESS,
    )


def describe_exit(code: int | None) -> str:
    """Popen.returncode in words: 'running', 'exited with code 3 (...)', 'killed by SIGKILL'."""
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    meaning = exits.MEANINGS.get(code)
    return f"exited with code {code}" + (f" ({meaning})" if meaning else "")


class RankFailed(CommandFailed, RuntimeError):
    """A rank ended before the cluster served (the message names it, and why)."""


@dataclass
class Failure:
    """The first rank that ended abnormally."""

    rank: int
    host: str
    code: int
    after_s: float  # seconds since supervision started
    cause: str = ""  # what a rank said about it (LastWords), if anything

    @property
    def signal_name(self) -> str | None:
        if self.code >= 0:
            return None
        try:
            return signal.Signals(-self.code).name
        except ValueError:
            return f"signal {-self.code}"

    def __str__(self) -> str:
        where = f"rank {self.rank}" + (f" ({self.host})" if self.host else "")
        return f"{where} {describe_exit(self.code)}" + (f": {self.cause}" if self.cause else "")

    @property
    def permanent(self) -> bool:
        """Starting again would fail the same way."""
        return self.code in exits.PERMANENT_EXITS


class Supervisor:
    """Watch one cluster's rank processes (rank i is procs[i])."""

    def __init__(
        self,
        procs: list[RankChild],
        hosts: list[str] | None = None,
        last_words: LastWords | None = None,
    ) -> None:
        self.procs = procs
        self.hosts = hosts or [""] * len(procs)
        self.last_words = last_words
        self.started = time.monotonic()
        self._exited_at: dict[int, float] = {}
        self._failure: Failure | None = None

    def poll(self) -> None:
        """Note the time each rank is first seen ended."""
        now = time.monotonic()
        for rank, p in enumerate(self.procs):
            if rank not in self._exited_at and p.poll() is not None:
                self._exited_at[rank] = now

    def first_failure(self) -> Failure | None:
        """The rank that ended abnormally first, once one has; it never changes afterwards."""
        self.poll()
        if self._failure is None:
            bad = [
                (at, self.procs[r].returncode in exits.CONSEQUENCES, r)
                for r, at in self._exited_at.items()
                if self.procs[r].returncode != 0
            ]
            if bad:
                at, _, rank = min(bad)
                code = self.procs[rank].returncode
                cause = self.last_words.cause(rank) if self.last_words else ""
                self._failure = Failure(rank, self.hosts[rank], code, at - self.started, cause)
        return self._failure

    def all_exited_cleanly(self) -> bool:
        return all(p.poll() == 0 for p in self.procs)

    def wait(self, stopping: Callable[[], bool] = lambda: False, interval: float = 0.1) -> None:
        """Block until a rank fails, every rank exited 0, or `stopping()` is true."""
        while not stopping() and self.first_failure() is None and not self.all_exited_cleanly():
            time.sleep(interval)

    def stop(self, timeout: float = 30.0, *, graceful_rank: int | None = 0) -> list[int]:
        """Stop every rank; return their exit codes.

        `graceful_rank` (rank 0 by default) gets SIGTERM first and most of `timeout` to
        shut the others down cleanly; then the rest get SIGTERM, then SIGKILL.
        """
        deadline = time.monotonic() + timeout
        if graceful_rank is not None and self.procs[graceful_rank].poll() is None:
            _signal(self.procs[graceful_rank], signal.SIGTERM)
            _wait_all(self.procs, deadline - 0.3 * timeout)
        for p in self.procs:
            if p.poll() is None:
                _signal(p, signal.SIGTERM)
        _wait_all(self.procs, deadline)
        for p in self.procs:
            if p.poll() is None:
                _signal(p, signal.SIGKILL)
        for p in self.procs:
            p.wait()
        self.poll()
        if self.last_words is not None:  # (their last lines before the launcher's verdict)
            self.last_words.drained()
        return [p.returncode for p in self.procs]


def _signal(p: RankChild, sig: signal.Signals) -> None:
    try:
        p.send_signal(sig)
    except ProcessLookupError:
        pass


def _wait_all(procs: list[RankChild], deadline: float) -> None:
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return


def run_with_restarts(
    start: Callable[[], Supervisor],
    restarts: int,
    *,
    ready: Callable[[Supervisor], None] | None = None,
    stop_event: threading.Event | None = None,
    report: Callable[[str], None] = print,
    stop_timeout: float = 30.0,
) -> int:
    """Start a cluster, watch it, and start it again after a failure, `restarts` times.

    `start` launches the ranks (if it raises, that counts as a failure, and it must not
    leave ranks behind); `ready` may then wait for them to serve (raising counts as a
    failure too, and the ranks are stopped). A failure that would repeat (bad options,
    a model that does not load) is not restarted. Returns 0 when the cluster ended
    cleanly or was stopped through `stop_event`, EXIT_RANK_FAILED when it failed with
    no restart left.
    """
    stop_event = stop_event or threading.Event()
    attempt = 0
    while True:
        failure = _run_once(start, ready, stop_event, stop_timeout, report)
        if failure is None:
            return 0
        if not failure.message:
            return exits.EXIT_RANK_FAILED  # stopped, but not cleanly (already reported)
        if stop_event.is_set():
            report(f"{failure.message}; stopped")
            return exits.EXIT_RANK_FAILED
        if failure.permanent:
            left = "; not restarted: it would fail the same way" if restarts else ""
            report(f"{failure.message}; the cluster was stopped{left}")
            return exits.EXIT_RANK_FAILED
        if attempt >= restarts:
            left = " (no restart left)" if restarts else ""
            report(f"{failure.message}; the cluster was stopped{left}")
            return exits.EXIT_RANK_FAILED
        attempt += 1
        report(f"{failure.message}; the cluster was stopped; restart {attempt} of {restarts}")


@dataclass
class _Outcome:
    """How one life of a cluster went wrong ('' once already reported)."""

    message: str
    permanent: bool = False


def _run_once(
    start: Callable[[], Supervisor],
    ready: Callable[[Supervisor], None] | None,
    stop_event: threading.Event,
    stop_timeout: float,
    report: Callable[[str], None],
) -> _Outcome | None:
    """One life of the cluster: None if it ended cleanly, else what went wrong."""
    try:
        supervisor = start()
    except Exception as e:  # noqa: BLE001 - not coming up is a failure like any other
        return None if stop_event.is_set() else _Outcome(str(e) or type(e).__name__)
    failure: _Outcome | None = None
    try:
        if ready is not None:
            ready(supervisor)
        supervisor.wait(stop_event.is_set)
    except Exception as e:  # noqa: BLE001
        failure = _Outcome(str(e) or type(e).__name__)
    found = supervisor.first_failure()
    if found is not None:
        if failure is None or str(found) not in failure.message:
            failure = _Outcome(str(found))
        failure.permanent = found.permanent
    elif stop_event.is_set():
        failure = None  # stopped (maybe while starting): not a failure
    codes = supervisor.stop(stop_timeout)
    if failure is None:
        bad = [f"rank {r} {describe_exit(c)}" for r, c in enumerate(codes) if c != 0]
        if bad:  # asked to stop, and some rank did not stop cleanly
            report("stopped, but " + "; ".join(bad))
            return _Outcome("")
    return failure
