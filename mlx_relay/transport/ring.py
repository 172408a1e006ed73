"""One hop of the ring: header first, then the payload the header announces.

Every rank receives from its left neighbour and sends to its right one, which is all
the ring backend allows. Nothing here decides anything: the header says what follows.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_relay.protocol import header as hdr
from mlx_relay.transport.doorbell import Doorbell

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
    """One hop: the header over the doorbell, the payload over the ring.

    Payload sends and receives are *posted*: queued on the device's streams with
    `mx.async_eval`, never waited for here, so a rank builds its next graph while its
    device computes and the link carries the last one. The streams run posted
    operations in the order they were posted, which keeps every rank's payload sends
    and receives paired. Headers travel on the doorbell (see doorbell.py), once the
    payload they announce is computed: a receive is posted only when its data is
    there. An earlier header (sent when the step is decided) would let the next rank
    build its graph sooner, but its receive then waits inside the device's streams: on
    a CPU the ring backend busy-polls the core the rank computes on, and on CUDA the
    receiving kernels spin on the GPU; with two ranks sharing one H200 that stalled the
    first decode step for good.
    """

    def __init__(self, group: mx.distributed.Group, doorbell: Doorbell) -> None:
        self.group = group
        self.doorbell = doorbell
        self.rank = group.rank()
        self.size = group.size()
        self.next = (self.rank + 1) % self.size
        self.prev = (self.rank - 1) % self.size

    def send_header(self, header: hdr.StepHeader) -> None:
        """Announce a step to the right neighbour: one signed zmq message."""
        self.doorbell.ring(hdr.encode(header).tobytes())

    def send_payload(self, header: hdr.StepHeader, payload: mx.array | None) -> mx.array | None:
        """Post the payload the header announced; returns the posted send (or None)."""
        shape = hdr.payload_nbytes_shape(header)
        if not shape:
            return None
        if payload is None or tuple(payload.shape) != shape:
            raise hdr.ProtocolError(f"{header.describe()} announces a payload of shape {shape}")
        sent = mx.distributed.send(payload, self.next, group=self.group)
        mx.async_eval(sent)
        return sent

    def send(self, header: hdr.StepHeader, payload: mx.array | None = None) -> mx.array | None:
        """Wait for the payload, announce it, and post its send."""
        if payload is not None:
            mx.eval(payload)
        self.send_header(header)
        return self.send_payload(header, payload)

    def recv_header(self, timeout: float | None = None) -> hdr.StepHeader:
        """The next header from the left neighbour; DoorbellTimeout after `timeout` s."""
        return hdr.decode(np.frombuffer(self.doorbell.wait(timeout), dtype=np.int32))

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
