"""The worker loop: receive a step, do exactly what its header says, pass it on.

A worker never samples, never sees text, never decides to stop. What it does with a
step is its stage's (stage.py: no transport there); this loop waits for headers, moves
the arrays, and tells rank 0 over the control link what a header cannot carry (a
failure's words, a load's report). Whatever happens inside a step, the step's
communication completes (zeros of the announced shape if it failed) and its header
flags the failure, so the ring never falls out of step and rank 0 learns what broke.

In a tensor group (transport/tensor.py) a worker holds a slice of every layer of its
stage and takes each FLAG_TENSOR step with the group's other ranks: it passes the
header on first (so every peer starts at once; with one stage, the last one's copy is
rank 0's acknowledgement), then receives the hidden state by the group's broadcast and
runs its slices. In a stage x tensor grid a stage's first rank receives the state from
the stage before over the ring and gives it to its stage by that broadcast, and the
stage's last rank sends the stage's output on (to rank 0 from the last stage) with the
header, as a pipeline rank does. A peer that cannot build such a step cannot keep its
group's collectives in step (the others wait in the layers' all-sums for it): it
reports why and exits, and rank 0 names it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, NoReturn

import mlx.core as mx
import zmq

from mlx_relay import timeline
from mlx_relay.protocol import control
from mlx_relay.protocol import header as hdr
from mlx_relay.protocol.exits import EXIT_RING_BROKEN, EXIT_TENSOR_STEP_FAILED
from mlx_relay.transport.doorbell import DoorbellTimeout, NeighbourGone
from mlx_relay.transport.link import ControlLink
from mlx_relay.transport.ring import Ring, mx_dtype
from mlx_relay.transport.tensor import TensorGroup
from mlx_relay.worker.stage import StepError, Taken, WorkerStage, described
from mlx_relay.worker.staging import Stager

log = logging.getLogger("mlx_relay.worker")


class Worker:
    def __init__(self, ring: Ring, link: ControlLink, tensor: TensorGroup | None = None) -> None:
        self.ring = ring
        self.link = link
        self.rank = ring.rank
        send = link.reporter("stage")  # (the staging thread's own socket)
        stager = Stager(
            ring.rank, link.secret, link.rank0_host, lambda p: send(control.STAGING, {"staging": p})
        )
        self.stage = WorkerStage(ring.rank, ring.size, tensor, stager)
        self._posted: Any = None  # the last step's sends, alive until they ran
        # Forward steps taken, and the seconds from each one's header arriving to its output
        # computed (receiving its input included; with eager hops, to its part queued):
        # rank 0 shows them as metrics per rank.
        self.steps = 0
        self.step_seconds = 0.0

    def run(self) -> None:
        """The loop: sleep until a step's doorbell rings, take the step, pass it on."""
        poller = zmq.Poller()
        bell = self.ring.doorbell.fileno()
        poller.register(bell, zmq.POLLIN)
        poller.register(self.link.socket, zmq.POLLIN)
        while True:
            self.link.state = "waiting"
            events = dict(poller.poll())
            if self.link.socket in events and self.link.bye_received():
                log.info("rank %d: rank 0 said bye", self.rank)
                return
            if bell not in events:
                continue
            try:
                header = self.ring.recv_header(timeout=0)
            except DoorbellTimeout:
                continue
            except NeighbourGone as e:
                # Rank 0 stopping, or the rank before this one gone: either way rank 0
                # has the word (a bye, or the heartbeat thread finds it gone).
                log.warning("rank %d: %s; waiting for rank 0's word", self.rank, e)
                poller.unregister(bell)
                continue
            timeline.mark("header", header.step_id)
            self.link.state = "busy"
            started = time.perf_counter()
            if header.flags & hdr.FLAG_TENSOR:
                self._tensor_step(header)
            else:
                self._ring_step(header)
            if header.cmd == hdr.CMD_FORWARD:
                self.steps += 1
                self.step_seconds += time.perf_counter() - started
            self.link.done_step = header.step_id  # rank 0 can tell who holds an overdue step
            if header.cmd == hdr.CMD_SHUTDOWN:
                fenced = f" ({self.ring.fenced} hops waited for a shape change)"
                log.info("rank %d: shutdown%s", self.rank, fenced if self.ring.fences else "")
                return

    def _ring_step(self, header: hdr.StepHeader) -> None:
        """A step of the ring: its payload and side arrays received, acted on, passed on
        (any failure of the step itself travels in the header: see WorkerStage.take)."""
        try:
            payload = self.ring.post_recv_payload(header)
            if payload is not None:
                timeline.mark_when_computed("received", header.step_id, payload)
            # (side arrays: received after the payload, passed on as far as later
            # ranks need them; the last rank sends none back. Most models' steps
            # have none.)
            sides = self.ring.post_recv_sides(header) if header.sides else []
            received = [payload, *sides]
            taken = self.stage.take(header, payload, sides)
            self._report(header, taken)
        except RuntimeError as e:  # mx.distributed: a neighbour's connection is gone
            self._ring_broke(e)
        self._send_on(header, taken, received)
        if header.cmd == hdr.CMD_SHUTDOWN:
            self.ring.flush()  # (rank 0 waits for the step to come back)

    def _send_on(
        self, header: hdr.StepHeader, taken: Taken, received: list[mx.array | None]
    ) -> None:
        """Pass a step on to the next rank: its header, and what this rank sends of it
        (`taken`), posted once `received` (what its graph reads) allow."""
        timeline.mark("built", header.step_id)
        if taken.out is not None and header.cmd == hdr.CMD_FORWARD:
            timeline.mark_when_computed("output", header.step_id, taken.out)
        try:
            self._posted = self.ring.send(header, taken.out, taken.sides, reads=received)
        except RuntimeError as e:
            self._ring_broke(e)
        # (The last step's sends are dropped here: on CUDA a ring send's event is
        # freed, which waits for the whole GPU; the mark shows how long.)
        timeline.mark("released", header.step_id)

    def _ring_broke(self, e: RuntimeError) -> NoReturn:
        log.error("rank %d: the ring broke: %s; waiting for rank 0's word", self.rank, e)
        self.link.ring_broken(str(e))
        raise SystemExit(EXIT_RING_BROKEN) from None

    def _tensor_step(self, header: hdr.StepHeader) -> None:
        """A FLAG_TENSOR forward step: the header on (see the module's docstring), then
        this rank's slices of its stage's layers on the stage's input, posted; a grid
        stage's last rank then sends the output on."""
        timing = header.cmd == hdr.CMD_TIME_ALL_SUM  # (--tensor-parallel auto, at load)
        tensor = self.stage.timed_group(header) if timing else self.stage.split
        received: list[mx.array] = []
        try:
            if tensor is None:
                raise StepError(hdr.ERR_BAD_HEADER, "a tensor step reached a rank with no group")
            if tensor.grid and tensor.first and not timing:  # (the stage before's output)
                payload = self.ring.post_recv_payload(header)
                received = [payload, *self.ring.post_recv_sides(header)]
            if not tensor.last:  # (the stage's peers start at once)
                self.ring.send_header(alone(header))
            if timing:
                seconds = tensor.time_all_sum(header.payload_shape, mx_dtype(header.payload_dtype))
                if tensor.last:  # (a pair's second rank: its figure on, with the header)
                    header.lengths[self.rank] = round(seconds * 1e6)
                    self.ring.send_header(alone(header))
                return
            if received:
                self.ring.settle(*received)  # (CUDA: before the kernels that read them)
                h, sides = tensor.broadcast(received[0]), tensor.send_all(received[1:])
            else:
                h, sides = tensor.receive(header)
            out = self.stage.forward(header, h, sides)
            if tensor.last:
                taken = self.stage.passed_on(header, out, sides)
        except Exception as e:  # noqa: BLE001 - the group cannot go on without this rank
            message = described(e)
            log.error("rank %d: %s failed: %s", self.rank, header.describe(), message)
            self.link.send(control.ERROR, step_id=header.step_id, message=message)
            raise SystemExit(EXIT_TENSOR_STEP_FAILED) from None
        if tensor.last:
            self._send_on(header, taken, received)
            return
        mx.async_eval(out)
        self._posted = out  # (alive until it ran: the next step's posting drops it)

    def timings(self) -> dict[str, float]:
        """For the side channel's stats (read from the heartbeat thread)."""
        return {"steps": self.steps, "step_seconds": self.step_seconds}

    def _report(self, header: hdr.StepHeader, taken: Taken) -> None:
        """Tell rank 0 what the step's header alone cannot: why it failed here, or what a
        load left on this rank."""
        if taken.failure is not None:
            self.link.send(control.ERROR, step_id=header.step_id, message=taken.failure)
        if taken.loaded is not None:
            self.link.send(control.LOADED, **taken.loaded)


def alone(header: hdr.StepHeader) -> hdr.StepHeader:
    """`header` as it goes on with no payload behind it (a stage's first rank to its
    peers: whatever came inline with it stays here)."""
    return dataclasses.replace(header, flags=header.flags & ~hdr.FLAG_INLINE)
