"""Rank 0's end of the pyzmq side channel (the hub); each worker's end is `link.py`.

Rank 0 binds one ROUTER socket. Each worker connects two DEALER sockets: `cmd`, used
by its main thread (hello, errors, and rank 0's 'bye' while it waits for a step), and
`hb`, owned by a heartbeat thread that keeps talking while the main thread is blocked
inside a collective. Messages are signed (protocol.control); bad ones are dropped, never
acted on, and logged without flooding the log (droplog.py: one line per source per 10 s).

Rank 0 learns that a worker is gone in two ways. A process that dies (crash, kill -9,
OOM killer) closes its sockets at once: rank 0's next heartbeat to it fails with
EHOSTUNREACH (ROUTER_MANDATORY), so the rank counts as gone about half a second later
unless it reconnects. A process that is stopped, hung or cut off keeps its sockets
open and is found by silence instead: no heartbeat for the heartbeat timeout.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.utils.monitor

from mlx_relay.protocol import control
from mlx_relay.transport.droplog import DropLog, peer_of

log = logging.getLogger("mlx_relay.sidechannel")

SEND_RETRY_S = 5.0  # how long rank 0 keeps trying to reach a worker socket
RING_BLAME_S = 1.5  # a rank reporting a broken ring is blamed only if nobody is gone by then
PROBE_INTERVAL_S = 0.1  # how often rank 0 retries a worker whose connection closed


@dataclass
class RankInfo:
    rank: int
    host: str = ""
    pid: int = 0
    state: str = "starting"
    last_seen: float = field(default_factory=time.monotonic)
    stats: dict[str, Any] = field(default_factory=dict)
    fingerprint: str = ""
    done_step: int = 0  # the last step it passed on, as of its last message
    hb_attached: bool = False  # its heartbeat socket has talked to rank 0
    unreachable_since: float | None = None  # rank 0's sends to it fail since then
    gone: str = ""  # why rank 0 counts it as gone ("" while it is there)
    ring_broken: str = ""  # what its mx.distributed connection reported, if it broke
    ring_broken_at: float = 0.0
    versions: dict[str, str] = field(default_factory=dict)  # its hello's control.versions()
    staging: dict[str, Any] = field(default_factory=dict)  # its last control.STAGING

    @property
    def where(self) -> str:
        return f"rank {self.rank}" + (f" ({self.host})" if self.host else "")


@dataclass
class LinkFailure:
    """A worker that rank 0 can no longer count on, and why (for the user)."""

    rank: int
    host: str
    reason: str

    def __str__(self) -> str:
        return f"rank {self.rank}" + (f" ({self.host})" if self.host else "") + f": {self.reason}"


class ControlHub:
    """Rank 0's end: tracks every worker's liveness and collects error details."""

    def __init__(
        self,
        endpoint: str,
        world_size: int,
        secret: bytes,
        heartbeat_interval: float = 0.5,
    ) -> None:
        self.world_size = world_size
        self.secret = secret
        self.host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0]  # (where it binds)
        self.heartbeat_interval = heartbeat_interval
        self.ranks: dict[int, RankInfo] = {}
        self.rejected = 0
        self.dropped = DropLog(log, "side channel")
        self._exits_expected = False
        self._errors: dict[tuple[int, int], str] = {}
        self._cond = threading.Condition()
        self._outbox: queue.SimpleQueue[tuple[bytes, list[bytes]]] = queue.SimpleQueue()
        self._ctx = zmq.Context.instance()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to an unknown peer raises
        self._router.bind(endpoint)
        self._said_hello: set[int] = set()
        self._retry: list[tuple[float, bytes, list[bytes]]] = []
        self._wakeup_pull = self._ctx.socket(zmq.PULL)
        self._wakeup_addr = f"inproc://hub-{id(self)}"
        self._wakeup_pull.bind(self._wakeup_addr)
        self._push_lock = threading.Lock()
        self._wakeup_push = self._ctx.socket(zmq.PUSH)
        self._wakeup_push.connect(self._wakeup_addr)
        self._stop = threading.Event()
        # The hub thread's own hold-ups: a worker's silence is not counted across one, so
        # that a rank 0 starved on a busy machine, or stopped and resumed, blames no
        # worker whose heartbeats it has not read yet.
        self._hold_ups = control.HoldUps(heartbeat_interval)
        self._thread = threading.Thread(target=self._run, name="control-hub", daemon=True)
        self._thread.start()

    # --- called from other threads -------------------------------------------------
    def send(self, rank: int, kind: str, body: dict[str, Any] | None = None) -> None:
        frames = control.encode(kind, body or {}, self.secret)
        self._outbox.put((control.identity(rank, "cmd"), frames))
        with self._push_lock:
            self._wakeup_push.send(b"")

    def bye(self) -> None:
        for rank in range(1, self.world_size):
            self.send(rank, control.BYE)

    def wait_for_hello(self, timeout: float) -> list[int]:
        """Wait until every worker said hello; returns the ranks still missing."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                missing = [r for r in range(1, self.world_size) if r not in self._said_hello]
                left = deadline - time.monotonic()
                if not missing or left <= 0:
                    return missing
                self._cond.wait(left)

    def take_error(self, step_id: int, rank: int, timeout: float = 2.0) -> str | None:
        """The message a rank sent about a failed step (it may trail the header a little)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (step_id, rank) not in self._errors:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._errors.pop((step_id, rank))

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def failure(self, heartbeat_timeout: float) -> LinkFailure | None:
        """The first worker that is gone (its connection closed) or silent too long.

        A worker that only reports a broken ring is usually the neighbour of one that
        died; it is named only if no rank turns out to be gone within RING_BLAME_S.
        """
        now = time.monotonic()
        with self._cond:
            for rank, info in sorted(self.ranks.items()):
                if info.gone and not self._exits_expected:
                    return LinkFailure(rank, info.host, f"{info.gone} (pid {info.pid})")
                silent = self._silence(info, now)
                if silent > heartbeat_timeout:
                    return LinkFailure(
                        rank,
                        info.host,
                        f"no heartbeat for {silent:.1f} s (pid {info.pid}); the rank is "
                        "stopped, hung or cut off from rank 0",
                    )
            for rank, info in sorted(self.ranks.items()):
                if info.ring_broken and now - info.ring_broken_at > RING_BLAME_S:
                    return LinkFailure(
                        rank, info.host, f"its ring connection broke: {info.ring_broken}"
                    )
        return None

    def _silence(self, info: RankInfo, now: float) -> float:
        """How long `info`'s rank has been silent as far as this hub can tell: not
        counting a hold-up of the hub's own, past or still going on (zero while it is)."""
        if self._hold_ups.behind(now):
            return 0.0  # the hub thread itself is behind: it cannot tell
        return now - max(info.last_seen, self._hold_ups.until)

    def wait_failure(self, heartbeat_timeout: float, timeout: float) -> LinkFailure | None:
        """`failure()`, waiting up to `timeout` for one to show (after the ring broke)."""
        deadline = time.monotonic() + timeout
        while (found := self.failure(heartbeat_timeout)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            with self._cond:
                self._cond.wait(min(left, 0.05))
        return found

    def suspect(self, step_id: int) -> LinkFailure | None:
        """The first rank (in ring order) that has not passed step `step_id` on, and how
        it looks from here: silent, or alive but not done (slow or hung)."""
        with self._cond:
            for rank in sorted(self.ranks):
                info = self.ranks[rank]
                if info.done_step >= step_id:
                    continue
                silent = self._silence(info, time.monotonic())
                if silent > 1.5 * self.heartbeat_interval:
                    how = f"silent for {silent:.1f} s"
                else:
                    how = f"alive and {info.state}, but not done with it"
                return LinkFailure(rank, info.host, f"has not passed the step on ({how})")
        return None

    def expect_exits(self) -> None:
        """Workers are being shut down: their closing connections are no failure."""
        with self._cond:
            self._exits_expected = True

    def clear_staging(self) -> None:
        """Forget every worker's staging report (a new staging starts)."""
        with self._cond:
            for info in self.ranks.values():
                info.staging = {}

    def snapshot(self) -> dict[int, RankInfo]:
        with self._cond:
            return {r: RankInfo(**vars(info)) for r, info in self.ranks.items()}

    def close(self) -> None:
        """Stop the hub thread; messages already queued (a last bye) are still sent."""
        self._stop.set()
        with self._push_lock:
            self._wakeup_push.send(b"")
        self._thread.join(timeout=2)
        self._flush()
        self.dropped.flush()
        for sock in (self._router, self._wakeup_pull, self._wakeup_push):
            sock.close(linger=0)

    # --- the hub thread ------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wakeup_pull, zmq.POLLIN)
        next_beat = time.monotonic()
        while not self._stop.is_set():
            timeout_ms = max(0, int((next_beat - time.monotonic()) * 1000))
            if self._retry:
                timeout_ms = min(timeout_ms, 10)
            events = dict(poller.poll(timeout_ms))
            self._hold_ups.turn(time.monotonic())
            if self._wakeup_pull in events:
                while self._wakeup_pull.poll(0):
                    self._wakeup_pull.recv()
            pending, self._retry = self._retry, []
            while True:
                try:
                    identity, frames = self._outbox.get_nowait()
                except queue.Empty:
                    break
                pending.append((time.monotonic() + SEND_RETRY_S, identity, frames))
            for deadline, identity, frames in pending:
                self._send_or_retry(deadline, identity, frames)
            if self._router in events:
                while self._router.poll(0):
                    self._receive(self._router.recv_multipart(copy=False))
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self.heartbeat_interval
                if self._beat():
                    next_beat = min(next_beat, time.monotonic() + PROBE_INTERVAL_S)

    def _flush(self) -> None:
        """Send what is still queued, once (the hub thread has stopped)."""
        while True:
            try:
                identity, frames = self._outbox.get_nowait()
            except queue.Empty:
                return
            try:
                self._router.send_multipart([identity, *frames], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _beat(self) -> bool:
        """Heartbeat every worker; note whose connection closed. True if any is unreachable."""
        beat = control.encode(control.HEARTBEAT, {}, self.secret)
        now = time.monotonic()
        probing = False
        for rank in range(1, self.world_size):
            try:
                self._router.send_multipart(
                    [control.identity(rank, "hb"), *beat], flags=zmq.NOBLOCK
                )
                reachable = True
            except zmq.Again:
                reachable = True  # connected, but not reading (stopped?): silence will tell
            except zmq.ZMQError:
                reachable = False  # not connected: not yet, or not any more
            with self._cond:
                info = self.ranks.get(rank)
                if info is None or not info.hb_attached:
                    continue
                if reachable:
                    info.unreachable_since = None
                    continue
                if info.unreachable_since is None:
                    info.unreachable_since = now
                if now - info.unreachable_since < control.LINK_GRACE_S:
                    probing = True
                elif not info.gone:
                    info.gone = (
                        "its side-channel connection closed: the process exited or was killed"
                    )
                    log.error("side channel: %s: %s", info.where, info.gone)
                    self._cond.notify_all()
        return probing

    def _send_or_retry(self, deadline: float, identity: bytes, frames: list[bytes]) -> None:
        """A worker's socket may not be attached yet; keep trying for a while, then log."""
        try:
            log.debug("side channel: -> %s", identity.decode())
            self._router.send_multipart([identity, *frames], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if time.monotonic() < deadline:
                self._retry.append((deadline, identity, frames))
            else:
                log.warning("side channel: could not reach %s: %s", identity.decode(), e)

    def _reject(self, first: zmq.Frame, reason: object) -> None:
        """Drop a message not from the cluster; count it where `wait_for` sees it."""
        self.dropped.drop(peer_of(first), reason)
        with self._cond:
            self.rejected += 1
            self._cond.notify_all()

    def _receive(self, zframes: list[zmq.Frame]) -> None:
        frames = [f.bytes for f in zframes]
        sender = control.parse_identity(frames[0]) if frames else None
        try:
            if sender is None:
                raise control.BadMessage(f"unknown sender identity {frames[0][:16]!r}")
            message = control.decode(frames[1:], self.secret)
        except control.BadMessage as e:
            self._reject(zframes[0], e)
            return
        rank, role = sender
        if not 0 < rank < self.world_size or message.get("rank") != rank:
            self._reject(zframes[0], f"claims rank {message.get('rank')!r}")
            return
        kind = message["kind"]
        with self._cond:
            info = self.ranks.setdefault(rank, RankInfo(rank=rank))
            info.last_seen = time.monotonic()
            info.unreachable_since = None
            info.gone = ""
            if role == "hb":
                info.hb_attached = True
            if kind == control.HELLO:
                self._said_hello.add(rank)
                info.host = str(message.get("host", ""))
                info.pid = int(message.get("pid", 0))
                info.versions = dict(message.get("versions") or {})
                info.state = "ready"
            if kind == control.STAGING:
                info.staging = dict(message.get("staging") or {})
            if kind in (control.HELLO, control.HEARTBEAT, control.LOADED):
                info.stats.update(message.get("stats") or {})
                info.state = str(message.get("state", info.state))
                info.done_step = int(message.get("done", info.done_step))
            if kind == control.LOADED:
                info.fingerprint = str(message.get("fingerprint", ""))
            if kind == control.ERROR and message.get("ring"):
                info.ring_broken = str(message.get("message", ""))
                info.ring_broken_at = time.monotonic()
                log.error(
                    "side channel: %s: ring connection broke: %s", info.where, info.ring_broken
                )
            elif kind == control.ERROR:
                self._errors[(int(message.get("step_id", -1)), rank)] = str(
                    message.get("message", "")
                )
            self._cond.notify_all()
