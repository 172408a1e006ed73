"""Doorbells: each hop's header travels here, and a rank sleeps until one arrives.

The ring backend's `recv` busy-polls a core for as long as it waits. Measured on the
2-vCPU machines this project is tested on, one spinning process slows a computing
process on the other vCPU by almost half (53 s -> 98 s for the same matmuls), and on a
laptop-class Mac an idle-but-spinning cluster is heat and battery for nothing. So each
step's header goes over a zmq PUSH/PULL pair between ring neighbours, and only the
payload over the ring: the receiver blocks in zmq (no CPU) until a header arrives,
then posts the ring receive the header announces. Waiting in zmq also gives rank 0 a
timeout, which `mx.distributed` has not.

A header goes out once the payload it announces is computed (ring.py says why not
sooner), and as a zmq message it does not queue behind the device's work as a ring
message would: one message per hop tells the next rank everything, and wakes it.
"""

from __future__ import annotations

import json
import logging
import os
import time

import zmq

from mlx_relay.protocol import control
from mlx_relay.transport.droplog import DropLog, peer_of

log = logging.getLogger("mlx_relay.doorbell")

DOORBELLS_ENV = "MLX_RELAY_DOORBELLS"  # JSON list of tcp:// endpoints, one per rank
DEFAULT_DOORBELL_PORT = 50160  # + rank, on each rank's host from the hostfile


SEND_TIMEOUT_S = 2


class DoorbellTimeout(TimeoutError):
    pass


class NeighbourGone(RuntimeError):
    """The right neighbour takes no message: it is gone (a RuntimeError, as the ring
    backend raises when a peer's connection breaks)."""


def doorbell_endpoints(size: int, hosts: list[str]) -> list[str]:
    raw = os.environ.get(DOORBELLS_ENV)
    if raw:
        endpoints = json.loads(raw)
        if len(endpoints) != size:
            raise ValueError(f"{DOORBELLS_ENV} lists {len(endpoints)} endpoints for {size} ranks")
        return endpoints
    return [f"tcp://{hosts[r]}:{DEFAULT_DOORBELL_PORT + r}" for r in range(size)]


class Doorbell:
    def __init__(self, rank: int, size: int, endpoints: list[str], secret: bytes) -> None:
        self.secret = secret
        self.dropped = DropLog(log, f"rank {rank}'s doorbell")
        ctx = zmq.Context.instance()
        self.incoming = ctx.socket(zmq.PULL)
        self.incoming.setsockopt(zmq.LINGER, 0)
        self.incoming.bind(endpoints[rank])
        self.outgoing = ctx.socket(zmq.PUSH)
        self.outgoing.setsockopt(zmq.LINGER, 0)
        self.outgoing.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_S * 1000)
        self.outgoing.connect(endpoints[(rank + 1) % size])

    def ring(self, message: bytes) -> None:
        """Send to the right neighbour. A live one never makes this wait (zmq queues up
        to its high-water mark); a gone one does, and that is a broken ring, as the ring
        backend would report it."""
        try:
            self.outgoing.send_multipart(control.sign(message, self.secret))
        except zmq.Again:
            raise NeighbourGone(
                f"[doorbell] no connection to the next rank: a header waited {SEND_TIMEOUT_S} s"
            ) from None

    def wait(self, timeout: float | None = None) -> bytes:
        """The next message from the left neighbour (waiting forever if timeout is None).

        Junk (anything not signed with the cluster's secret) is dropped and counted, and
        does not extend `timeout`: a flood of it cannot hide a neighbour that went quiet.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait_ms = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if not self.incoming.poll(wait_ms):
                raise DoorbellTimeout(f"no step arrived within {timeout:.1f} s")
            frames = self.incoming.recv_multipart(copy=False)
            try:
                return control.verify([f.bytes for f in frames], self.secret)
            except control.BadMessage as e:
                self.dropped.drop(peer_of(frames[0]), e)  # not from our neighbour

    def close(self) -> None:
        self.dropped.flush()
        self.incoming.close(linger=0)
        self.outgoing.close(linger=0)
