"""The pyzmq side channel between rank 0 (the hub) and every worker (a link).

Rank 0 binds one ROUTER socket. Each worker connects two DEALER sockets: `cmd`, used
by its main thread (hello, errors, and rank 0's 'bye' while it waits for a step), and
`hb`, owned by a heartbeat thread that keeps talking while the main thread is blocked
inside a collective. Messages are signed (protocol.control); bad ones are dropped and
logged, never acted on.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from mlx_relay.protocol import control

log = logging.getLogger("mlx_relay.sidechannel")

EXIT_RANK0_SILENT = 75
SEND_RETRY_S = 5.0  # how long rank 0 keeps trying to reach a worker socket  # a worker exits with this when rank 0 stops talking


def _identity(rank: int, role: str) -> bytes:
    return f"rank{rank}-{role}".encode()


def _parse_identity(identity: bytes) -> tuple[int, str] | None:
    try:
        name, role = identity.decode().split("-", 1)
        return int(name.removeprefix("rank")), role
    except (UnicodeDecodeError, ValueError):
        return None


@dataclass
class RankInfo:
    rank: int
    host: str = ""
    pid: int = 0
    state: str = "starting"
    last_seen: float = field(default_factory=time.monotonic)
    stats: dict[str, Any] = field(default_factory=dict)


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
        self.heartbeat_interval = heartbeat_interval
        self.ranks: dict[int, RankInfo] = {}
        self.rejected = 0
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
        self._thread = threading.Thread(target=self._run, name="control-hub", daemon=True)
        self._thread.start()

    # --- called from other threads -------------------------------------------------
    def send(self, rank: int, kind: str, body: dict[str, Any] | None = None) -> None:
        frames = control.encode(kind, body or {}, self.secret)
        self._outbox.put((_identity(rank, "cmd"), frames))
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

    def silent_ranks(self, timeout: float) -> list[int]:
        now = time.monotonic()
        with self._cond:
            return [r for r, info in self.ranks.items() if now - info.last_seen > timeout]

    def snapshot(self) -> dict[int, RankInfo]:
        with self._cond:
            return {r: RankInfo(**vars(info)) for r, info in self.ranks.items()}

    def close(self) -> None:
        self._stop.set()
        with self._push_lock:
            self._wakeup_push.send(b"")
        self._thread.join(timeout=2)
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
                    self._receive(self._router.recv_multipart())
            if time.monotonic() >= next_beat:
                beat = control.encode(control.HEARTBEAT, {}, self.secret)
                for rank in range(1, self.world_size):
                    try:
                        self._router.send_multipart([_identity(rank, "hb"), *beat])
                    except zmq.ZMQError:
                        pass  # that worker's heartbeat socket is not connected (yet, or any more)
                next_beat = time.monotonic() + self.heartbeat_interval

    def _send_or_retry(self, deadline: float, identity: bytes, frames: list[bytes]) -> None:
        """A worker's socket may not be attached yet; keep trying for a while, then log."""
        try:
            log.debug("side channel: -> %s", identity.decode())
            self._router.send_multipart([identity, *frames])
        except zmq.ZMQError as e:
            if time.monotonic() < deadline:
                self._retry.append((deadline, identity, frames))
            else:
                log.warning("side channel: could not reach %s: %s", identity.decode(), e)

    def _receive(self, frames: list[bytes]) -> None:
        sender = _parse_identity(frames[0]) if frames else None
        try:
            if sender is None:
                raise control.BadMessage("unknown sender identity")
            message = control.decode(frames[1:], self.secret)
        except control.BadMessage as e:
            self.rejected += 1
            log.warning("side channel: dropped a message from %r: %s", frames[:1], e)
            return
        rank, _role = sender
        if not 0 < rank < self.world_size or message.get("rank") != rank:
            self.rejected += 1
            log.warning("side channel: dropped a message claiming rank %r", message.get("rank"))
            return
        kind = message["kind"]
        with self._cond:
            info = self.ranks.setdefault(rank, RankInfo(rank=rank))
            info.last_seen = time.monotonic()
            if kind == control.HELLO:
                self._said_hello.add(rank)
                info.host = str(message.get("host", ""))
                info.pid = int(message.get("pid", 0))
                info.state = "ready"
            if kind in (control.HELLO, control.HEARTBEAT, control.LOADED):
                info.stats.update(message.get("stats") or {})
                info.state = str(message.get("state", info.state))
            if kind == control.ERROR:
                self._errors[(int(message.get("step_id", -1)), rank)] = str(
                    message.get("message", "")
                )
            self._cond.notify_all()


class ControlLink:
    """A worker's end: hello, error details, rank 0's bye, and heartbeats."""

    def __init__(
        self,
        endpoint: str,
        rank: int,
        secret: bytes,
        heartbeat_interval: float = 0.5,
        rank0_timeout: float = 10.0,
        stats: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.rank = rank
        self.secret = secret
        self.state = "ready"
        self._stats = stats or (lambda: {})
        self._ctx = zmq.Context.instance()
        self._cmd = self._dealer(endpoint, "cmd")
        self._hb_endpoint = endpoint
        self._interval = heartbeat_interval
        self._rank0_timeout = rank0_timeout
        self._stop = threading.Event()
        self._hb_thread = threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True)

    def _dealer(self, endpoint: str, role: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, _identity(self.rank, role))
        sock.setsockopt(zmq.LINGER, 500)
        sock.connect(endpoint)
        return sock

    def _body(self, **extra: Any) -> dict[str, Any]:
        return {"rank": self.rank, "state": self.state, **extra}

    def send(self, kind: str, **extra: Any) -> None:
        self._cmd.send_multipart(control.encode(kind, self._body(**extra), self.secret))

    def hello(self) -> None:
        self.send(control.HELLO, host=socket.gethostname(), pid=os.getpid(), stats=self._stats())
        self._hb_thread.start()

    @property
    def socket(self) -> zmq.Socket:
        """The command socket, for polling beside the doorbell."""
        return self._cmd

    def bye_received(self) -> bool:
        """Consume waiting messages; True if rank 0 said bye."""
        bye = False
        while self._cmd.poll(0):
            try:
                message = control.decode(self._cmd.recv_multipart(), self.secret)
            except control.BadMessage as e:
                log.warning("side channel: dropped a message: %s", e)
                continue
            bye = bye or message["kind"] == control.BYE
        return bye

    def close(self) -> None:
        self._stop.set()
        if self._hb_thread.is_alive():
            self._hb_thread.join(timeout=2)
        self._cmd.close(linger=500)

    def _heartbeats(self) -> None:
        sock = self._dealer(self._hb_endpoint, "hb")
        last_rank0 = time.monotonic()
        try:
            while not self._stop.is_set():
                body = self._body(stats=self._stats())
                sock.send_multipart(control.encode(control.HEARTBEAT, body, self.secret))
                deadline = time.monotonic() + self._interval
                while (left := deadline - time.monotonic()) > 0 and not self._stop.is_set():
                    if sock.poll(int(left * 1000) + 1):
                        try:
                            control.decode(sock.recv_multipart(), self.secret)
                            last_rank0 = time.monotonic()
                        except control.BadMessage as e:
                            log.warning("side channel: dropped a message: %s", e)
                if time.monotonic() - last_rank0 > self._rank0_timeout:
                    log.error(
                        "rank %d: rank 0 silent for %.1f s; exiting so this machine's memory is freed",
                        self.rank,
                        time.monotonic() - last_rank0,
                    )
                    os._exit(EXIT_RANK0_SILENT)
        finally:
            sock.close(linger=0)
