"""Supervision of a cluster's rank processes, for every launcher.

A launcher hands over one `Popen` per rank. The supervisor notices the first rank
that ends abnormally, says which one and how ("rank 1 (127.0.0.1) killed by SIGKILL"),
and stops the rest: SIGTERM to rank 0 first (it drains and shuts the ring down with
CMD_SHUTDOWN), then SIGTERM to whatever remains, then SIGKILL. `run_with_restarts`
starts the cluster again after a failure, up to N times.

When one rank dies, others follow on purpose (rank 0 exits EXIT_CLUSTER_FAILED after
answering its clients, workers exit EXIT_RANK0_SILENT when rank 0 goes quiet), so the
cause is the rank seen ending first; among ranks seen ending at the same poll, one
that ended for its own reasons is preferred to one that only followed.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

# Exit codes with a meaning across the project (kept here so that a launcher can
# explain them without importing the coordinator; tests check they stay in sync).
EXIT_CLUSTER_FAILED = 3  # rank 0: a worker failed or a step was overdue (server.py)
EXIT_RANK_FAILED = 4  # a launcher: a rank failed and the cluster was stopped
EXIT_RANK0_SILENT = 75  # a worker: rank 0 is gone or silent (sidechannel.py)
EXIT_RING_BROKEN = 76  # a worker: its ring connection broke, a neighbour died (sidechannel.py)

_MEANINGS = {
    EXIT_CLUSTER_FAILED: "the cluster failed",
    EXIT_RANK_FAILED: "a rank failed",
    EXIT_RANK0_SILENT: "rank 0 is gone or silent",
    EXIT_RING_BROKEN: "its ring connection broke",
}
_CONSEQUENCES = (EXIT_CLUSTER_FAILED, EXIT_RANK0_SILENT, EXIT_RING_BROKEN)


def describe_exit(code: int | None) -> str:
    """Popen.returncode in words: 'running', 'exited with code 3 (...)', 'killed by SIGKILL'."""
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    meaning = _MEANINGS.get(code)
    return f"exited with code {code}" + (f" ({meaning})" if meaning else "")


@dataclass
class Failure:
    """The first rank that ended abnormally."""

    rank: int
    host: str
    code: int
    after_s: float  # seconds since supervision started

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
        return f"{where} {describe_exit(self.code)}"


class Supervisor:
    """Watch one cluster's rank processes (rank i is procs[i])."""

    def __init__(self, procs: list[subprocess.Popen], hosts: list[str] | None = None) -> None:
        self.procs = procs
        self.hosts = hosts or [""] * len(procs)
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
                (at, self.procs[r].returncode in _CONSEQUENCES, r)
                for r, at in self._exited_at.items()
                if self.procs[r].returncode != 0
            ]
            if bad:
                at, _, rank = min(bad)
                code = self.procs[rank].returncode
                self._failure = Failure(rank, self.hosts[rank], code, at - self.started)
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
        return [p.returncode for p in self.procs]


def _signal(p: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        p.send_signal(sig)
    except ProcessLookupError:
        pass


def _wait_all(procs: list[subprocess.Popen], deadline: float) -> None:
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
    failure too, and the ranks are stopped). Returns 0 when the cluster ended cleanly
    or was stopped through `stop_event`, EXIT_RANK_FAILED when it failed with no
    restart left.
    """
    stop_event = stop_event or threading.Event()
    attempt = 0
    while True:
        failure = _run_once(start, ready, stop_event, stop_timeout, report)
        if failure is None:
            return 0
        if failure == "":
            return EXIT_RANK_FAILED  # stopped, but not cleanly (already reported)
        if stop_event.is_set():
            report(f"{failure}; stopped")
            return EXIT_RANK_FAILED
        if attempt >= restarts:
            left = " (no restart left)" if restarts else ""
            report(f"{failure}; the cluster was stopped{left}")
            return EXIT_RANK_FAILED
        attempt += 1
        report(f"{failure}; the cluster was stopped; restart {attempt} of {restarts}")


def _run_once(
    start: Callable[[], Supervisor],
    ready: Callable[[Supervisor], None] | None,
    stop_event: threading.Event,
    stop_timeout: float,
    report: Callable[[str], None],
) -> str | None:
    """One life of the cluster: None if it ended cleanly, else what went wrong."""
    try:
        supervisor = start()
    except Exception as e:  # noqa: BLE001 - not coming up is a failure like any other
        return None if stop_event.is_set() else str(e) or type(e).__name__
    failure: str | None = None
    try:
        if ready is not None:
            ready(supervisor)
        supervisor.wait(stop_event.is_set)
    except Exception as e:  # noqa: BLE001
        failure = str(e) or type(e).__name__
    found = supervisor.first_failure()
    if found is not None:
        failure = str(found) if failure is None or str(found) in failure else failure
    elif stop_event.is_set():
        failure = None  # stopped (maybe while starting): not a failure
    codes = supervisor.stop(stop_timeout)
    if failure is None:
        bad = [f"rank {r} {describe_exit(c)}" for r, c in enumerate(codes) if c != 0]
        if bad:  # asked to stop, and some rank did not stop cleanly
            report("stopped, but " + "; ".join(bad))
            return ""
    return failure
