"""A worker's end of the pyzmq side channel (the link); rank 0's end is `hub.py`.

Two DEALER sockets: `cmd`, used by the worker's main thread (hello, error details, and
rank 0's 'bye' while it waits for a step), and `hb`, owned by a heartbeat thread that
keeps talking while the main thread is blocked inside a collective. The heartbeat
thread also watches rank 0: when rank 0's connection closes, or rank 0 stays silent,
it ends the process (EXIT_RANK0_SILENT) so that the machine's memory is freed instead
of held by a rank nobody will ever send a step again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.utils.monitor

from mlx_relay.protocol import control
from mlx_relay.protocol.exits import EXIT_RANK0_SILENT
from mlx_relay.transport.droplog import DropLog

log = logging.getLogger("mlx_relay.sidechannel")


FIRST_ANSWER_S = 30.0  # silence allowed before rank 0's first answer (see _heartbeats)
RANK0_PATIENCE = 3.0  # a worker waits this many heartbeat timeouts on a silent rank 0
RANK0_PATIENCE_MIN_S = 10.0  # and never less than this


def rank0_patience(heartbeat_timeout: float) -> float:
    """How long a worker bears a rank 0 that is silent but still connected before leaving.

    Longer than rank 0 waits on a worker, on purpose: rank 0 is the one that detects a
    failure and names it, and a worker leaving on its own is only the last resort that
    frees the memory of a machine whose rank 0 is gone for good (a rank 0 that died is
    found by its closed connection within control.LINK_GRACE_S all the same). With the
    same 3 s on both sides, a rank 0 whose side-channel thread was starved 3.4 s on an
    overloaded machine (two test workers' clusters on two cores) lost its whole cluster
    to a worker that gave up on it.
    """
    return max(RANK0_PATIENCE * heartbeat_timeout, RANK0_PATIENCE_MIN_S)


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
        self.done_step = 0  # the worker loop sets it after passing each step on
        self._stats = stats or (lambda: {})
        self.dropped = DropLog(log, "side channel")
        self._ctx = zmq.Context.instance()
        self._cmd = self._dealer(endpoint, "cmd")
        self._hb_endpoint = endpoint
        self._interval = heartbeat_interval
        self._rank0_timeout = rank0_timeout
        self._stop = threading.Event()
        self._hb_thread = threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True)

    def _dealer(self, endpoint: str, role: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, control.identity(self.rank, role))
        sock.setsockopt(zmq.LINGER, 500)
        sock.connect(endpoint)
        return sock

    def _body(self, **extra: Any) -> dict[str, Any]:
        return {"rank": self.rank, "state": self.state, "done": self.done_step, **extra}

    def send(self, kind: str, **extra: Any) -> None:
        self._cmd.send_multipart(control.encode(kind, self._body(**extra), self.secret))

    def hello(self) -> None:
        self.send(
            control.HELLO,
            host=control.host_name(),
            pid=os.getpid(),
            stats=self._stats(),
            versions=control.versions(),
        )
        self._hb_thread.start()

    def reporter(self, role: str) -> Callable[[str, dict[str, Any]], None]:
        """A sender for another thread of this worker (a zmq socket serves one thread at
        a time): its own DEALER, opened on its first message, in that thread."""
        sock: list[zmq.Socket] = []

        def send(kind: str, body: dict[str, Any]) -> None:
            if not sock:
                sock.append(self._dealer(self._hb_endpoint, role))
            sock[0].send_multipart(control.encode(kind, self._body(**body), self.secret))

        return send

    def ring_broken(self, message: str) -> None:
        """Tell rank 0 this rank's mx.distributed connection broke, then wait for its bye.

        Rank 0 names the rank that is actually gone; this one stays reachable meanwhile
        (leaving would make it look like the culprit) and exits when told, or when rank
        0 goes silent.
        """
        self.state = "ring-broken"
        self.send(control.ERROR, step_id=-1, ring=True, message=message)
        while not self.bye_received():
            self._cmd.poll(1000)

    @property
    def rank0_host(self) -> str:
        """Rank 0's address as this rank reaches its side channel."""
        return self._hb_endpoint.removeprefix("tcp://").rsplit(":", 1)[0]

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
                self.dropped.drop("rank 0's end", e)
                continue
            bye = bye or message["kind"] == control.BYE
        return bye

    def close(self) -> None:
        self._stop.set()
        if self._hb_thread.is_alive():
            self._hb_thread.join(timeout=2)
        self._cmd.close(linger=500)

    def _heartbeats(self) -> None:
        """Beat every interval; exit the process when rank 0 is gone or silent.

        Rank 0 counts as gone when its connection closes (its process died) and stays
        closed for control.LINK_GRACE_S, or when nothing came from it for `rank0_timeout`
        (before its first answer, for FIRST_ANSWER_S at least: a rank 0 still starting,
        importing and loading beside the other ranks of a busy machine, answered its
        first heartbeat after more than 3 s; a rank 0 that died is found by its closed
        connection all the same).
        """
        sock = self._dealer(self._hb_endpoint, "hb")
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        last_rank0 = time.monotonic()
        hold_ups = control.HoldUps(self._interval)
        answered = False
        closed_at: float | None = None
        try:
            while not self._stop.is_set():
                body = self._body(stats=self._stats())
                try:
                    sock.send_multipart(
                        control.encode(control.HEARTBEAT, body, self.secret), flags=zmq.NOBLOCK
                    )
                except zmq.Again:
                    pass  # nobody to take it: silence or the closed link will tell
                deadline = time.monotonic() + self._interval
                if closed_at is not None:
                    deadline = min(deadline, closed_at + control.LINK_GRACE_S)
                while (left := deadline - time.monotonic()) > 0 and not self._stop.is_set():
                    events = dict(poller.poll(int(left * 1000) + 1))
                    if monitor in events:
                        event = zmq.utils.monitor.recv_monitor_message(monitor)["event"]
                        closed_at = time.monotonic() if event == zmq.EVENT_DISCONNECTED else None
                    if sock in events:
                        try:
                            control.decode(sock.recv_multipart(), self.secret)
                            last_rank0, answered = time.monotonic(), True
                        except control.BadMessage as e:
                            self.dropped.drop("rank 0's end", e)
                now = time.monotonic()
                hold_ups.turn(now)  # (this thread held up: rank 0's silence counts again)
                last_rank0 = max(last_rank0, hold_ups.until)
                if closed_at is not None and now - closed_at >= control.LINK_GRACE_S:
                    why = "rank 0's side-channel connection closed (its process exited or died)"
                elif now - last_rank0 > (
                    self._rank0_timeout if answered else max(self._rank0_timeout, FIRST_ANSWER_S)
                ):
                    why = f"rank 0 silent for {now - last_rank0:.1f} s"
                else:
                    continue
                if self._stop.is_set():
                    return
                log.error("rank %d: %s; exiting so this machine's memory is freed", self.rank, why)
                logging.shutdown()
                os._exit(EXIT_RANK0_SILENT)
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
