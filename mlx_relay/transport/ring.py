"""One hop of the ring: header first, then the payload the header announces.

Every rank receives from its left neighbour and sends to its right one, which is all
the ring backend allows. Nothing here decides anything: the header says what follows.
When a hop goes, and what rank 0 may do before its return came, is the ring's `Hops`
(hops.py, one class per `--hop-mode`); the Ring moves the bytes and answers rank 0's
questions about a step from it. A transport of another kind (JACCL RDMA) plugs in as
a Hops of its own plus its byte moving in `_post_send` and `_post_recv`.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_relay import timeline
from mlx_relay.device import on_cuda
from mlx_relay.protocol import header as hdr
from mlx_relay.transport.collective import PayloadGroups
from mlx_relay.transport.doorbell import MAX_MESSAGE_BYTES, Doorbell
from mlx_relay.transport.hops import (  # noqa: F401 - the modes' names, as callers know them
    ADAPTIVE,
    COLLECTIVE,
    EAGER,
    HOP_MODES,
    INLINE_BACK_MAX_BYTES,
    PAIRED_MODES,
    READY,
    hops_for,
)
from mlx_relay.transport.outbox import Outbox

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


# How a hop is timed (`--hop-mode`): hops.py, one class a mode.
AUTO = "auto"
# Cores a rank needs for eager hops to pay: its compute, plus one spinning on a receive.
EAGER_CORES_PER_RANK = 4
# READY hops send a payload up to this size in the header's message (FLAG_INLINE): it is
# computed and on the host by then, and one message per hop wakes the next rank with
# its input in hand, where a ring send waits for the sender's CPU stream to run it and
# the receive for the receiver's. Larger ones (prefill chunks, batches of many rows)
# take the ring. Small, so that the few messages a busy neighbour may not have read yet
# (one per step in flight) always fit in the sockets' buffers: a doorbell's send never
# waits on a live neighbour, and a send that waits SEND_TIMEOUT_S means a broken ring.
# 16 KiB: one row of any model up to a hidden size of 8,192 in 16 bits.
INLINE_MAX_BYTES = 1 << 14
INLINE_ENV = "MLX_RELAY_INLINE_MAX_BYTES"
_HEADER_BYTES = hdr.HEADER_LEN * 4  # (int32s: what comes before an inline payload)
# The last rank reads each inline return on the host. On CUDA, MLX first moves a device
# buffer the host reads into managed memory, with a copy that waits for the work queued
# on the GPU: under load the next step's half, ~10 ms, in about one step of seven (two
# H200s, bench/RESULTS.md, session 20). A moved buffer stays managed, and MLX's buffer
# cache hands a freed buffer to the next array of about its size (up to two pages
# more), so on CUDA each return is padded by this much, to a size no array of the
# layers has: the cache gives it a buffer an earlier return had, already managed.
RETURN_PAD_BYTES = 8 << 20


def choose_hop_mode(
    requested: str, backend: str, *, cores: int, ranks_here: int, gpu_pair: bool = False
) -> str:
    """The hop mode for `--hop-mode requested` (AUTO or one of HOP_MODES); `gpu_pair`:
    every rank of the cluster is on a CUDA GPU of its own (collective.gpu_tags), so each
    neighbouring pair can hop over an NCCL communicator of its own (two ranks or more).

    AUTO gives such a pair ADAPTIVE hops: a lone step hops collectively, and a token
    costs what one process's does (two H100s, Llama-3-8B's shape, single stream: 0.98 of
    mlx-lm against EAGER's 0.67), while steps in flight together return apart from
    it (16 streams on two H200s: 399-408 tok/s against EAGER's 374-383; COLLECTIVE on
    two H100s 264-280 against EAGER's 405-413; bench/RESULTS.md).
    Elsewhere AUTO picks EAGER where what it costs is free and it was seen to pay. Its
    receives run on CPU streams of their own, which MPI does not allow (MLX's plain
    MPI_Init is not thread-safe). A posted receive spins one core, so a rank needs
    EAGER_CORES_PER_RANK cores (on a 2-core box running 2 ranks the spinning threads take
    the cores the ranks compute on, and READY is several times faster). A GPU rank with
    the cores hops EAGER too: on CUDA, where receives are settled (see Ring), eager hops
    still let every rank build its part of a step while the ranks before it compute
    (0.48-0.52 of mlx-lm against READY's 0.43-0.44 single-stream, 328 tok/s against 296
    with 16 streams); on Metal nothing is settled and a rank's kernels wait for their
    input on the GPU, launched.
    """
    if requested != AUTO:
        if requested not in HOP_MODES:
            raise ValueError(f"hop mode {requested!r}: expected auto, {', '.join(HOP_MODES)}")
        if requested == EAGER and backend == "mpi":
            raise ValueError("eager hops need the ring or jaccl backend, not mpi")
        return requested
    if backend == "mpi":
        return READY
    if gpu_pair:
        return ADAPTIVE
    return EAGER if cores >= EAGER_CORES_PER_RANK * max(1, ranks_here) else READY


def payload_nbytes(header: hdr.StepHeader) -> int:
    """The size in bytes of the payload the header announces."""
    return mx_dtype(header.payload_dtype).size * math.prod(hdr.payload_nbytes_shape(header))


def host_view(payload: mx.array) -> mx.array:
    """`payload` as NumPy can read it: bfloat16 as its 16 bits (NumPy has no bfloat16)."""
    return payload.view(mx.uint16) if payload.dtype == mx.bfloat16 else payload


def inline_max_bytes() -> int:
    """The largest payload a READY hop sends in its header's message, from
    MLX_RELAY_INLINE_MAX_BYTES (default INLINE_MAX_BYTES; 0: every payload takes the ring)."""
    raw = os.environ.get(INLINE_ENV, str(INLINE_MAX_BYTES))
    limit = MAX_MESSAGE_BYTES - _HEADER_BYTES
    if not raw.isdigit() or int(raw) > limit:
        raise ValueError(f"{INLINE_ENV}={raw!r}: expected a number of bytes up to {limit:,}")
    return int(raw)


def settles_here() -> bool:
    """Whether this process's ring settles receives (see Ring): on CUDA, unless
    MLX_RELAY_SETTLE_RECEIVES says otherwise (1 or 0; the tests run the CUDA path on a CPU)."""
    forced = os.environ.get("MLX_RELAY_SETTLE_RECEIVES")
    if forced is not None:
        return forced == "1"
    return on_cuda()


FENCE_ENV = "MLX_RELAY_FENCE_SHAPES"


def fences_here(backend: str) -> bool:
    """Whether this process's ring fences shape changes (see Ring): under the JACCL
    backend, unless MLX_RELAY_FENCE_SHAPES says otherwise (1 or 0; the tests run the
    fenced path on the ring backend)."""
    forced = os.environ.get(FENCE_ENV)
    if forced is not None:
        return forced == "1"
    return backend.startswith("jaccl")


class Ring:
    """One hop: the header over the doorbell, the payload over the ring.

    Payload sends and receives are *posted*: queued on the device's streams with
    `mx.async_eval`, never waited for here, so a rank builds its next graph while its
    device computes and the link carries the last one. The streams run posted
    operations in the order they were posted, which keeps every rank's payload sends
    and receives paired. In EAGER mode sends and receives each run on a CPU stream of
    their own, so a receive posted before its data arrived waits there, not in front of
    the rank's computation or its sends.

    On CUDA (`settles`) a rank waits for a receive to finish before it launches the
    kernels that read it. Launched earlier, they wait on the GPU in a spinning kernel
    (MLX's wait for an event that a CPU stream signals), and while one spins, loading a
    JIT-compiled kernel module (`cuModuleLoadDataEx`: a quantized matmul's first use
    at a new size) does not return: on two H200s a rank hung there for good, at the
    first decode step with eager hops and in a 4,000-token prefill with ready ones.
    Collective hops (`payloads`) wait on the device inside NCCL instead: nothing settles.

    With `fences` (the JACCL backend), a send or receive of another shape than the last
    one posted in its direction waits for that one to finish first. JACCL has delivered
    wrong data, or hung, for back-to-back point-to-point transfers of different shapes
    (mlx issue 3149; a barrier between them avoided it), and a hop must never hand a
    step another step's data. Decode steps keep one shape, so only a prompt's chunks,
    and the steps after them, pay the wait.
    """

    def __init__(
        self,
        group: mx.distributed.Group,
        doorbell: Doorbell,
        mode: str = READY,
        *,
        settles: bool | None = None,
        payloads: PayloadGroups | None = None,
        fences: bool = False,
    ) -> None:
        self.hops = hops_for(mode)
        if self.hops.paired != (payloads is not None):
            raise ValueError("collective and adaptive hops, and only they, take payload groups")
        self.group = group
        self.doorbell = doorbell
        self.mode = mode
        self.payloads = payloads
        self.eager = self.hops.eager
        self.settles = self.hops.settles(settles_here() if settles is None else settles)
        self.rank = group.rank()
        self.size = group.size()
        self.next = (self.rank + 1) % self.size
        self.prev = (self.rank - 1) % self.size
        self._streams = threading.local()
        self.inline_max = inline_max_bytes() if self.hops.carries_inline else 0
        # (every header leaves through it; the doorbell is looked up when one does)
        self.outbox = Outbox(lambda message: self.doorbell.ring(message), f"outbox-{self.rank}")
        self._inline: tuple[int, bytes] | None = None  # (step id, payload) of the last header
        self.fences = fences
        self.fenced = 0  # transfers that waited for the one before (shape changes)
        self._last: dict[str, tuple[tuple[Any, ...], mx.array]] = {}  # direction: (kind, op)

    def choose_path(
        self, header: hdr.StepHeader, *, alone: bool, returned_width: int | None = None
    ) -> None:
        """Rank 0, launching a step (`alone`: no other step is in flight, and none
        follows it at once as a prompt's next chunk does;
        `returned_width`: hdr.returned's): mark in its header which of its hops are
        all-sums (COLLECTIVE: both; ADAPTIVE: both for a lone step, else the hop out of
        rank 0, whose receiver then launches its part at once, with no wait on its
        host) and whether the return comes inline (ADAPTIVE, a step beside others, if
        it fits)."""
        self.hops.choose_path(
            header,
            alone=alone,
            returned_bytes=lambda: payload_nbytes(hdr.returned(header, returned_width)),
        )

    def returns_inline(self, header: hdr.StepHeader) -> bool:
        """Whether the hop of the step back to rank 0 carries its payload inline."""
        return bool(header.flags & hdr.FLAG_INLINE_BACK)

    # (rank 0's questions about a step it launched: its ring driver asks these, never
    # which mode runs)
    def announces_at_launch(self) -> bool:
        """Whether a step goes on as soon as it is launched (else once computed)."""
        return self.hops.eager

    def posts_return_at_launch(self, header: hdr.StepHeader) -> bool:
        """Whether the receive of the step's return is posted when it is launched."""
        return self.hops.posts_return_at_launch(header)

    def returns_early(self, header: hdr.StepHeader) -> bool:
        """Whether rank 0 may build on the step's return before it came (hops.py)."""
        return self.hops.returns_early(header)

    def settles_return(self, header: hdr.StepHeader, back: hdr.StepHeader) -> bool:
        """Whether the receive of the step's return (its header `back`) is to be waited
        for before what reads it launches: with `settles`, unless it is an all-sum
        (waited for on the device) or its bytes came with the header."""
        return (
            self.settles
            and not self.receives_collectively(header)
            and not back.flags & hdr.FLAG_INLINE
        )

    def sends_collectively(self, header: hdr.StepHeader) -> bool:
        """Whether this rank's hop of the step is an all-sum (its header says so)."""
        return self._collective(header, self.rank)

    def receives_collectively(self, header: hdr.StepHeader) -> bool:
        """Whether the hop of the step into this rank is an all-sum."""
        return self._collective(header, self.prev)

    def _collective(self, header: hdr.StepHeader, sender: int) -> bool:
        # (OUT: every hop on the way round; BACK: the last rank's hop back to rank 0)
        back = sender != 0 and (sender + 1) % self.size == 0
        flag = hdr.FLAG_COLLECTIVE_BACK if back else hdr.FLAG_COLLECTIVE_OUT
        if not header.flags & flag:
            return False
        if self.payloads is None:
            raise hdr.ProtocolError(
                f"{header.describe()} hops collectively, but this rank has {self.mode} hops"
            )
        return True

    def _stream(self, kind: str, collective: bool) -> mx.Stream | None:
        """The stream a payload's send or receive (`kind`) runs on. Collective: on CUDA
        a GPU stream of its own for receives, else the default. Otherwise EAGER: this
        thread's CPU stream for `kind`, made on first use (MLX streams belong to the
        thread that made them), unless the ring group carries collective hops too (not
        on CUDA): then the default, which keeps both kinds in the order they were posted."""
        if collective:
            if kind != "recv" or not self.payloads.separate_streams:
                return None
            device = mx.gpu
        elif self.payloads is not None and not self.payloads.separate_streams:
            return None
        elif self.eager:
            device = mx.cpu
        else:
            return None
        name = f"{kind}_{'gpu' if device == mx.gpu else 'cpu'}"
        stream = getattr(self._streams, name, None)
        if stream is None:
            stream = mx.new_stream(device)
            setattr(self._streams, name, stream)
        return stream

    def send_header(self, header: hdr.StepHeader, inline: bytes = b"") -> None:
        """Announce a step to the right neighbour: one signed message (with the payload's
        bytes after the header where it is FLAG_INLINE), after those posted before."""
        self.outbox.post(hdr.encode(header).tobytes() + inline)

    def send_payload(self, header: hdr.StepHeader, payload: mx.array | None) -> mx.array | None:
        """Post the payload the header announced; returns the posted send (or None)."""
        shape = hdr.payload_nbytes_shape(header)
        if not shape:
            return None
        if payload is None or tuple(payload.shape) != shape:
            raise hdr.ProtocolError(f"{header.describe()} announces a payload of shape {shape}")
        return self._post_send(payload, self.sends_collectively(header))

    def send(
        self,
        header: hdr.StepHeader,
        payload: mx.array | None = None,
        sides: Sequence[mx.array] = (),
        reads: Sequence[mx.array | None] = (),
    ) -> Any:
        """Announce the step and post its payload's send, then its side arrays' (the
        header lists them): at once in EAGER mode, once computed in READY mode. Returns
        what was posted, to be kept alive until it ran, or None where nothing was (the
        last rank's inline return goes through the outbox). What the header announces is
        checked first, so a mismatch never leaves half a step on the wire. `reads`: the
        receives the payload's graph reads, settled before it is launched (unless the
        hop into this rank is an all-sum: its receives are waited for on the device)."""
        collective = self.sends_collectively(header)
        shape = hdr.payload_nbytes_shape(header)
        if shape and (payload is None or tuple(payload.shape) != shape):
            raise hdr.ProtocolError(f"{header.describe()} announces a payload of shape {shape}")
        pairs = zip_sides(header, sides) if sides or header.sides else []
        for side, array in pairs:
            if tuple(array.shape) != side.shape or dtype_name(array.dtype) != side.dtype:
                raise hdr.ProtocolError(f"{header.describe()} announces a side array {side}")
        if self.next == 0 and self.rank != 0 and self.returns_inline(header):
            if pairs:
                raise hdr.ProtocolError(f"{header.describe()}: an inline return has no sides")
            self._return_inline(header, payload)
            timeline.mark("posted", header.step_id)
            return None
        self.hops.before_header(header, payload, list(sides), list(reads), self.settle)
        inline = self._inline_bytes(header, payload)
        self.send_header(header, inline)
        timeline.mark("header_sent", header.step_id)
        self.hops.after_header(
            header,
            list(reads),
            self.settle,
            received_collectively=self.eager and self.receives_collectively(header),
        )
        posted = None if header.flags & hdr.FLAG_INLINE else self.send_payload(header, payload)
        timeline.mark("posted", header.step_id)
        if pairs:
            posted = [posted, *(self._post_send(array, collective) for _, array in pairs)]
        return posted

    def _return_inline(self, header: hdr.StepHeader, payload: mx.array | None) -> None:
        """The last rank: post the payload's computation, and the header with the
        payload's bytes to the outbox, whose thread sends them once computed."""
        header.flags &= ~hdr.FLAG_INLINE  # (a forwarded header carries the last hop's)
        if payload is None:
            self.send_header(header)
            return
        header.flags |= hdr.FLAG_INLINE
        wire = host_view(payload).reshape(-1)
        nbytes = wire.nbytes
        if self.settles:  # (CUDA: see RETURN_PAD_BYTES)
            pad = mx.zeros((RETURN_PAD_BYTES // wire.itemsize,), wire.dtype)
            wire = mx.concatenate([wire, pad])
        mx.async_eval(wire)
        head, step_id = hdr.encode(header).tobytes(), header.step_id

        def message() -> bytes:
            mx.eval(wire)  # (only waits, with Python's lock let go)
            timeline.mark("computed", step_id)
            # (MLX moves a buffer the host reads to managed memory, allocating there:
            # `copied` tells that apart from the wait)
            data = np.asarray(wire).view(np.uint8)[:nbytes].tobytes()
            timeline.mark("copied", step_id)
            return head + data

        self.outbox.post(message)

    def _inline_bytes(self, header: hdr.StepHeader, payload: mx.array | None) -> bytes:
        """READY: a small computed payload's bytes, to travel in the header's message
        (the header's FLAG_INLINE says so); b"" where it takes the ring."""
        header.flags &= ~hdr.FLAG_INLINE  # (a forwarded header carries the last hop's)
        if (
            not self.inline_max  # (0 unless the hops carry payloads inline: READY)
            or payload is None
            or payload.nbytes > self.inline_max
            or header.sides
            or self.sends_collectively(header)
        ):
            return b""
        header.flags |= hdr.FLAG_INLINE
        return np.asarray(host_view(payload)).tobytes()

    def _post_send(self, array: mx.array, collective: bool) -> mx.array:
        """Post `array`'s computation, then its send: apart, so that the host does not
        wait for the device. (In one evaluation MLX's CUDA backend fences a device's
        output that a CPU stream reads by waiting on the host, so every rank would wait
        for its own layers before it could build anything else; posted first, the send
        waits for it on its own stream.)"""
        mx.async_eval(array)
        stream = self._stream("send", collective)
        if collective:  # (the receiver adds zeros: it gets `array`)
            sent = mx.distributed.all_sum(array, group=self.payloads.send, stream=stream)
        else:
            self._fence("send", (tuple(array.shape), array.dtype))
            sent = mx.distributed.send(array, self.next, group=self.group, stream=stream)
            self._posted("send", (tuple(array.shape), array.dtype), sent)
        mx.async_eval(sent)
        return sent

    def _fence(self, direction: str, kind: tuple[Any, ...]) -> None:
        """With `fences`: wait for the last transfer in `direction` if it had another
        shape or dtype (see the class)."""
        last = self._last.get(direction)
        if self.fences and last is not None and last[0] != kind:
            mx.eval(last[1])
            self.fenced += 1

    def _posted(self, direction: str, kind: tuple[Any, ...], op: mx.array) -> None:
        if self.fences:
            self._last[direction] = (kind, op)

    def flush(self) -> None:
        """Wait until every header posted has left (before a rank exits)."""
        self.outbox.drain()

    def settle(self, *receives: mx.array | None) -> None:
        """With `settles` (CUDA), wait until these receives are done (see the class)."""
        if self.settles:
            mx.eval(*(r for r in receives if r is not None))

    def recv_header(self, timeout: float | None = None) -> hdr.StepHeader:
        """The next header from the left neighbour; DoorbellTimeout after `timeout` s."""
        message = self.doorbell.wait(timeout)
        header = hdr.decode(np.frombuffer(message[:_HEADER_BYTES], dtype=np.int32))
        if header.flags & hdr.FLAG_INLINE:
            self._inline = (header.step_id, message[_HEADER_BYTES:])
        return header

    def post_recv_payload(self, header: hdr.StepHeader) -> mx.array | None:
        """Post the receive of the payload the header announces (None for no payload),
        over the ring or as an all-sum, as the header says; an inline one is at hand."""
        if header.flags & hdr.FLAG_INLINE:
            return self._take_inline(header)
        return self._post_recv(
            hdr.payload_nbytes_shape(header),
            header.payload_dtype,
            self.receives_collectively(header),
        )

    def _take_inline(self, header: hdr.StepHeader) -> mx.array:
        data = mx.array(self.take_inline_bytes(header))
        shape = hdr.payload_nbytes_shape(header)
        return data.view(mx_dtype(header.payload_dtype)).reshape(shape)

    def take_inline_bytes(self, header: hdr.StepHeader) -> np.ndarray:
        """The bytes of the inline payload that came with `header` (FLAG_INLINE), as a
        uint8 array: for a caller that writes them where it wants them."""
        step_id, data = self._inline or (None, b"")
        self._inline = None
        if step_id != header.step_id or len(data) != payload_nbytes(header):
            shape = hdr.payload_nbytes_shape(header)
            raise hdr.ProtocolError(f"{header.describe()}: its inline payload is not {shape}")
        return np.frombuffer(data, dtype=np.uint8)

    def post_recv_sides(self, header: hdr.StepHeader) -> list[mx.array]:
        """Post the receives of the side arrays the header lists, after its payload's."""
        collective = self.receives_collectively(header)
        return [self._post_recv(side.shape, side.dtype, collective) for side in header.sides]

    def _post_recv(self, shape: tuple[int, ...], dtype: str, collective: bool) -> mx.array | None:
        if not shape:
            return None
        stream = self._stream("recv", collective)
        if collective:  # (the sender's payload plus these zeros)
            zeros = mx.zeros(shape, mx_dtype(dtype), stream=stream)
            payload = mx.distributed.all_sum(zeros, group=self.payloads.recv, stream=stream)
        else:
            self._fence("recv", (tuple(shape), mx_dtype(dtype)))
            payload = mx.distributed.recv(
                shape, mx_dtype(dtype), self.prev, group=self.group, stream=stream
            )
            self._posted("recv", (tuple(shape), mx_dtype(dtype)), payload)
        mx.async_eval(payload)
        return payload


def zip_sides(
    header: hdr.StepHeader, sides: Sequence[mx.array]
) -> list[tuple[hdr.SideArray, mx.array]]:
    if len(sides) != len(header.sides):
        raise hdr.ProtocolError(
            f"{header.describe()} lists {len(header.sides)} side arrays, {len(sides)} given"
        )
    return list(zip(header.sides, sides, strict=True))


def bytes_payload(data: bytes) -> mx.array:
    return mx.array(np.frombuffer(data, dtype=np.uint8))


def payload_bytes(payload: mx.array) -> bytes:
    return bytes(np.array(payload, copy=False).tobytes())
