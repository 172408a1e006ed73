"""Doorbells: each hop's header travels here, and a rank sleeps until one arrives.

The ring backend's `recv` busy-polls a core for as long as it waits. Measured on the
2-vCPU machines this project is tested on, one spinning process slows a computing
process on the other vCPU by almost half (53 s -> 98 s for the same matmuls), and on a
laptop-class Mac an idle-but-spinning cluster is heat and battery for nothing. So each
step's header goes over a TCP connection of its own between ring neighbours, and only
the payload over the ring (a READY hop's small payload rides in the header's message:
ring.py): the receiver sleeps in `poll` (no CPU) until a header arrives, then posts the
ring receive the header announces. Waiting there also gives rank 0 a timeout, which
`mx.distributed` has not.

Plain sockets, not zmq: a zmq message crosses an I/O thread on each side, and where a
rank's core is busy each of those threads waits its turn. Through zmq a header took
0.43 ms to reach the next rank of a 2-rank CPU pipeline, through its own socket 0.08 ms
(bench/RESULTS.md, session 15): the sending thread writes to the kernel, and the kernel
wakes the receiver.

Each connection is made once, at start: a rank listens, connects to its right neighbour
and says a signed hello, and keeps the first connection whose hello is its left
neighbour's; strangers are dropped and counted. Then it stops listening, so nobody else
can reach a doorbell for the cluster's life. Every message is signed with the cluster's
secret; one that does not verify means the stream is garbled, and the connection is
treated as broken.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import struct
import time

from mlx_relay.protocol import control
from mlx_relay.transport.droplog import DropLog

log = logging.getLogger("mlx_relay.doorbell")

DOORBELLS_ENV = "MLX_RELAY_DOORBELLS"  # JSON list of tcp:// endpoints, one per rank
DEFAULT_DOORBELL_PORT = 50160  # + rank, on each rank's host from the hostfile

SEND_TIMEOUT_S = 2
CONNECT_TIMEOUT_S = 120.0  # for the neighbours to reach their doorbells at start
HELLO_TIMEOUT_S = 5.0  # for a connection to say who it is
MAX_MESSAGE_BYTES = 1 << 20
SOCKET_BUFFER_BYTES = 1 << 20
_LENGTH = struct.Struct("!I")
_MAC_BYTES = 32


class DoorbellTimeout(TimeoutError):
    pass


class DoorbellError(OSError):
    """A doorbell could not be set up: its address is taken, or a neighbour never came."""


class NeighbourGone(RuntimeError):
    """A neighbour's connection broke or went quiet mid-message (a RuntimeError, as the
    ring backend raises when a peer's connection breaks)."""


def doorbell_endpoints(size: int, hosts: list[str]) -> list[str]:
    raw = os.environ.get(DOORBELLS_ENV)
    if raw:
        endpoints = json.loads(raw)
        if len(endpoints) != size:
            raise ValueError(f"{DOORBELLS_ENV} lists {len(endpoints)} endpoints for {size} ranks")
        return endpoints
    return [f"tcp://{hosts[r]}:{DEFAULT_DOORBELL_PORT + r}" for r in range(size)]


def _address(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data), socket.MSG_WAITALL)
        if not chunk:
            raise NeighbourGone("[doorbell] the previous rank closed its connection")
        data += chunk
    return data


def _roomy(sock: socket.socket, option: int) -> None:
    """Room for the messages a busy neighbour has not read yet (the kernel may cap it)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
    except OSError:
        pass


class Doorbell:
    """A rank's two doorbell connections: from its left neighbour, to its right one."""

    def __init__(
        self,
        rank: int,
        size: int,
        endpoints: list[str],
        secret: bytes,
        *,
        timeout: float = CONNECT_TIMEOUT_S,
    ) -> None:
        self.secret = secret
        self.dropped = DropLog(log, f"rank {rank}'s doorbell")
        prev, nxt = (rank - 1) % size, (rank + 1) % size
        deadline = time.monotonic() + timeout
        try:
            listener = socket.create_server(_address(endpoints[rank]))
        except OSError as e:
            raise DoorbellError(
                f"cannot listen on {endpoints[rank]} for rank {rank}'s doorbell: {e.strerror}"
            ) from None
        outgoing = None
        try:
            outgoing = self._connect(endpoints[nxt], deadline, timeout)
            outgoing.sendall(self._frame(self._hello(rank, nxt)))
            self.incoming = self._accept(listener, self._hello(prev, rank), deadline)
        except BaseException:
            if outgoing is not None:
                outgoing.close()
            raise
        finally:
            listener.close()
        self.outgoing = outgoing
        self.outgoing.settimeout(SEND_TIMEOUT_S)
        self.incoming.settimeout(SEND_TIMEOUT_S)  # (for the rest of a message once begun)
        self._poll = select.poll()
        self._poll.register(self.incoming, select.POLLIN)

    @staticmethod
    def _hello(sender: int, receiver: int) -> bytes:
        return f"doorbell {sender}->{receiver}".encode()

    @staticmethod
    def _connect(endpoint: str, deadline: float, timeout: float) -> socket.socket:
        while True:
            try:
                sock = socket.create_connection(_address(endpoint), timeout=SEND_TIMEOUT_S)
            except OSError:
                if time.monotonic() > deadline:
                    raise DoorbellError(
                        f"the next rank's doorbell at {endpoint} took no connection "
                        f"within {timeout:.0f} s"
                    ) from None
                time.sleep(0.02)
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _roomy(sock, socket.SO_SNDBUF)
            return sock

    def _accept(self, listener: socket.socket, hello: bytes, deadline: float) -> socket.socket:
        """The first connection that says `hello`, signed; strangers are dropped."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([listener], [], [], left)[0]:
                host, port = listener.getsockname()[:2]
                raise DoorbellError(
                    f"the previous rank did not connect to this rank's doorbell at {host}:{port}"
                )
            sock, peer = listener.accept()
            sock.settimeout(HELLO_TIMEOUT_S)
            try:
                said = self._read(sock)
                if said != hello:
                    raise control.BadMessage(f"a hello from someone else: {said[:40]!r}")
            except (control.BadMessage, NeighbourGone, OSError) as e:
                self.dropped.drop(str(peer[0]), e)
                sock.close()
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _roomy(sock, socket.SO_RCVBUF)
            return sock

    def _frame(self, message: bytes) -> bytes:
        payload, mac = control.sign(message, self.secret)
        return _LENGTH.pack(len(payload)) + payload + mac

    def _read(self, sock: socket.socket) -> bytes:
        (n,) = _LENGTH.unpack(_read_exactly(sock, _LENGTH.size))
        if n > MAX_MESSAGE_BYTES:
            raise control.BadMessage(f"a message of {n:,} bytes")
        body = _read_exactly(sock, n + _MAC_BYTES)
        return control.verify([body[:n], body[n:]], self.secret)

    def fileno(self) -> int:
        """The incoming connection, for polling beside other sockets."""
        return self.incoming.fileno()

    def ring(self, message: bytes) -> None:
        """Send to the right neighbour. A live one never makes this wait long (the kernel
        buffers what it has not read yet); a gone one does, and that is a broken ring,
        as the ring backend would report it."""
        try:
            self.outgoing.sendall(self._frame(message))
        except TimeoutError:
            raise NeighbourGone(
                f"[doorbell] no connection to the next rank: a header waited {SEND_TIMEOUT_S} s"
            ) from None
        except OSError as e:
            raise NeighbourGone(f"[doorbell] the connection to the next rank broke: {e}") from None

    def wait(self, timeout: float | None = None) -> bytes:
        """The next message from the left neighbour (waiting forever if timeout is None);
        NeighbourGone if its connection closed or what came is not one of ours."""
        if not self._poll.poll(None if timeout is None else max(0, int(timeout * 1000))):
            raise DoorbellTimeout(f"no step arrived within {timeout:.1f} s")
        try:
            return self._read(self.incoming)
        except control.BadMessage as e:
            raise NeighbourGone(
                f"[doorbell] the connection from the previous rank is garbled: {e}"
            ) from None
        except OSError as e:
            raise NeighbourGone(
                f"[doorbell] the connection from the previous rank broke: {e}"
            ) from None

    def close(self) -> None:
        self.dropped.flush()
        self.incoming.close()
        self.outgoing.close()
