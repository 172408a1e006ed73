"""One hop of the ring: header first, then the payload the header announces.

Every rank receives from its left neighbour and sends to its right one, which is all
the ring backend allows. Nothing here decides anything: the header says what follows.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_relay.doorbell import Doorbell
from mlx_relay.protocol import header as hdr

_MX_DTYPES = {
    "float32": mx.float32,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
    "uint8": mx.uint8,
    "int32": mx.int32,
}


def mx_dtype(name: str) -> mx.Dtype:
    return _MX_DTYPES[name]


def dtype_name(dtype: mx.Dtype) -> str:
    for name, value in _MX_DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype {dtype} cannot travel on the ring")


class Ring:
    """The ring plus its doorbells: every hop rings as it is posted.

    Sends and receives are *posted*: queued on the device's streams with
    `mx.async_eval`, never waited for here, so a rank builds its next graph while its
    device computes and the link carries the last one. The streams run posted
    operations in the order they were posted, which is what keeps every rank's sends
    and receives paired. The doorbell rings when a send is posted, before its data is
    ready: a sleeping neighbour wakes while the data is still being computed, so the
    wake-up costs nothing on the critical path.
    """

    def __init__(self, group: mx.distributed.Group, doorbell: Doorbell) -> None:
        self.group = group
        self.doorbell = doorbell
        self.rank = group.rank()
        self.size = group.size()
        self.next = (self.rank + 1) % self.size
        self.prev = (self.rank - 1) % self.size

    def send(self, header: hdr.StepHeader, payload: mx.array | None = None) -> list[mx.array]:
        """Post the header, then the payload it announces; returns the posted sends.

        Errors in building `payload` were raised before this is called, so what is
        posted always matches the header.
        """
        shape = hdr.payload_nbytes_shape(header)
        if shape and payload is None:
            raise hdr.ProtocolError(f"{header.describe()} announces a payload but has none")
        # One post each: within one evaluation independent sends may run in any order.
        sent = [mx.distributed.send(mx.array(hdr.encode(header)), self.next, group=self.group)]
        mx.async_eval(sent[0])
        if shape:
            sent.append(mx.distributed.send(payload, self.next, group=self.group))
            mx.async_eval(sent[1])
        self.doorbell.ring(header.step_id)
        return sent

    def wait(self, timeout: float | None = None) -> None:
        """Sleep until the left neighbour rings; DoorbellTimeout after `timeout` seconds."""
        self.doorbell.wait(timeout)

    def recv_header(self) -> hdr.StepHeader:
        """Receive a header and read it: the one wait a worker has per hop."""
        raw = self.post_recv_header()
        mx.eval(raw)
        return hdr.decode(np.array(raw, copy=False))

    def post_recv_header(self) -> mx.array:
        raw = mx.distributed.recv((hdr.HEADER_LEN,), mx.int32, self.prev, group=self.group)
        mx.async_eval(raw)
        return raw

    def post_recv_payload(self, shape: tuple[int, ...], dtype: str) -> mx.array | None:
        """Post the receive of a payload of known shape (None for no payload)."""
        if not shape:
            return None
        payload = mx.distributed.recv(shape, mx_dtype(dtype), self.prev, group=self.group)
        mx.async_eval(payload)
        return payload


def bytes_payload(data: bytes) -> mx.array:
    return mx.array(np.frombuffer(data, dtype=np.uint8))


def payload_bytes(payload: mx.array) -> bytes:
    return bytes(np.array(payload, copy=False).tobytes())
