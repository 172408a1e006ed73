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
    """The ring plus its doorbells: every hop rings before it sends."""

    def __init__(self, group: mx.distributed.Group, doorbell: Doorbell) -> None:
        self.group = group
        self.doorbell = doorbell
        self.rank = group.rank()
        self.size = group.size()
        self.next = (self.rank + 1) % self.size
        self.prev = (self.rank - 1) % self.size

    def send(self, header: hdr.StepHeader, payload: mx.array | None = None) -> None:
        raw = mx.array(hdr.encode(header))
        if payload is not None:
            mx.eval(payload)  # compute first, so the neighbour is woken only when data is ready
        self.doorbell.ring(header.step_id)
        mx.eval(mx.distributed.send(raw, self.next, group=self.group))
        if hdr.payload_nbytes_shape(header):
            if payload is None:
                raise hdr.ProtocolError(f"{header.describe()} announces a payload but has none")
            mx.eval(mx.distributed.send(payload, self.next, group=self.group))

    def wait(self, timeout: float | None = None) -> None:
        """Sleep until the left neighbour rings; DoorbellTimeout after `timeout` seconds."""
        self.doorbell.wait(timeout)

    def recv_header(self) -> hdr.StepHeader:
        """Receive a header; call after `wait` so that the backend does not spin."""
        raw = mx.distributed.recv((hdr.HEADER_LEN,), mx.int32, self.prev, group=self.group)
        mx.eval(raw)
        return hdr.decode(np.array(raw, copy=False))

    def recv_payload(self, header: hdr.StepHeader) -> mx.array | None:
        shape = hdr.payload_nbytes_shape(header)
        if not shape:
            return None
        payload = mx.distributed.recv(
            shape, mx_dtype(header.payload_dtype), self.prev, group=self.group
        )
        mx.eval(payload)
        return payload


def bytes_payload(data: bytes) -> mx.array:
    return mx.array(np.frombuffer(data, dtype=np.uint8))


def payload_bytes(payload: mx.array) -> bytes:
    return bytes(np.array(payload, copy=False).tobytes())
