"""The worker: receive a step, do exactly what its header says, pass it on.

A worker never samples, never sees text, never decides to stop. Whatever happens
inside a step, it completes the step's communication (zeros of the announced shape
if it failed) and flags the failure in the header it forwards, so the ring never
falls out of step and rank 0 learns what broke.

In a tensor group (transport/tensor.py) a worker holds a slice of every layer and takes
each FLAG_TENSOR step with rank 0 and the group's other ranks: it passes the header on
first (so every peer starts at once; the last one's copy is rank 0's acknowledgement),
then receives the hidden state by the group's broadcast and runs its slices. A peer
that cannot build such a step cannot keep its group's collectives in step (the others
wait in the layers' all-sums for it): it reports why and exits, and rank 0 names it.
"""

from __future__ import annotations

import gc
import json
import logging
import time
import traceback
from typing import Any

import mlx.core as mx
import zmq

from mlx_relay import proctitle, timeline
from mlx_relay.model import memory, sharding, speed
from mlx_relay.model.default_model import resolve_model
from mlx_relay.model.kvcache import CacheError, SlotCaches
from mlx_relay.model.stage import forward_stage
from mlx_relay.model.step_inputs import pass_on
from mlx_relay.protocol import control
from mlx_relay.protocol import header as hdr
from mlx_relay.protocol.exits import EXIT_RING_BROKEN, EXIT_TENSOR_STEP_FAILED
from mlx_relay.transport.doorbell import DoorbellTimeout, NeighbourGone
from mlx_relay.transport.link import ControlLink
from mlx_relay.transport.ring import Ring, mx_dtype, payload_bytes
from mlx_relay.transport.tensor import TensorGroup

log = logging.getLogger("mlx_relay.worker")


class StepError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _described(e: Exception) -> str:
    """A step's failure as rank 0 is told it: a StepError's own words, else its type too."""
    return str(e) if isinstance(e, StepError) else f"{type(e).__name__}: {e}"


class Worker:
    def __init__(self, ring: Ring, link: ControlLink, tensor: TensorGroup | None = None) -> None:
        self.ring = ring
        self.link = link
        self.tensor = tensor
        self.rank = ring.rank
        self.is_last = ring.rank == ring.size - 1
        self.shard: sharding.Shard | None = None
        self.caches: SlotCaches | None = None
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
        (any failure of the step itself travels in the header: see `step`)."""
        try:
            payload = self.ring.post_recv_payload(header)
            if payload is not None:
                timeline.mark_when_computed("received", header.step_id, payload)
            # (side arrays: received after the payload, passed on as far as later
            # ranks need them; the last rank sends none back. Most models' steps
            # have none.)
            sides = self.ring.post_recv_sides(header) if header.sides else []
            received = [payload, *sides]
            out = self.step(header, payload, sides)
            timeline.mark("built", header.step_id)
            if out is not None and header.cmd == hdr.CMD_FORWARD:
                timeline.mark_when_computed("output", header.step_id, out)
            if header.sides:  # (what the next ranks need of them)
                layers = len(self.shard.layers) if self.shard is not None else 0
                sides = pass_on(header, sides, layers)
            self._posted = self.ring.send(
                header, out, sides if header.sides else (), reads=received
            )
            # (The last step's sends are dropped here: on CUDA a ring send's event
            # is freed, which waits for the whole GPU; the mark shows how long.)
            timeline.mark("released", header.step_id)
            if header.cmd == hdr.CMD_SHUTDOWN:
                self.ring.flush()  # (rank 0 waits for the step to come back)
        except RuntimeError as e:  # mx.distributed: a neighbour's connection is gone
            log.error("rank %d: the ring broke: %s; waiting for rank 0's word", self.rank, e)
            self.link.ring_broken(str(e))
            raise SystemExit(EXIT_RING_BROKEN) from None

    def _tensor_step(self, header: hdr.StepHeader) -> None:
        """A FLAG_TENSOR forward step: the header on (see the module's docstring), then
        this rank's slices of every layer on rank 0's hidden state, posted."""
        try:
            self.ring.send_header(header)
            if self.tensor is None:
                raise StepError(hdr.ERR_BAD_HEADER, "a tensor step reached a rank with no group")
            h, sides = self.tensor.receive(header)
            out = self._forward(header, h, sides)
        except Exception as e:  # noqa: BLE001 - the group cannot go on without this rank
            message = _described(e)
            log.error("rank %d: %s failed: %s", self.rank, header.describe(), message)
            self.link.send(control.ERROR, step_id=header.step_id, message=message)
            raise SystemExit(EXIT_TENSOR_STEP_FAILED) from None
        mx.async_eval(out)
        self._posted = out  # (alive until it ran: the next step's posting drops it)

    def timings(self) -> dict[str, float]:
        """For the side channel's stats (read from the heartbeat thread)."""
        return {"steps": self.steps, "step_seconds": self.step_seconds}

    def step(
        self, header: hdr.StepHeader, payload: mx.array | None, sides: list[mx.array] | None = None
    ) -> mx.array | None:
        """Act on one step; returns the payload to forward (the header is updated in place).

        A forward step is only built here, not waited for: the ring posts it and the
        device runs it while this loop already waits for the next header. Whatever
        fails while building (a cache that does not fit the header, a bad shape) is
        caught before anything is sent, so the failure still travels in the header.
        """
        try:
            out = self._act(header, payload, sides or [])
        except Exception as e:  # noqa: BLE001 - every failure must still complete the step
            code = e.code if isinstance(e, StepError) else hdr.ERR_EXCEPTION
            message = _described(e)
            log.error("rank %d: %s failed: %s", self.rank, header.describe(), message)
            log.debug("%s", traceback.format_exc())
            header.mark_failed(self.rank, code)
            self.link.send(control.ERROR, step_id=header.step_id, message=message)
            out = self._zeros_like_announced(header)
        return self._outgoing(header, out)

    def _outgoing(self, header: hdr.StepHeader, out: mx.array | None) -> mx.array | None:
        """The last rank returns what `hdr.set_returned_payload` says rank 0 awaits: of a
        forward step, each row's last position (the return hop of a 512-token prefill
        chunk carries one position, not 512), all of it when rank 0 asked for the output
        and its first value otherwise, which tells rank 0 the step was computed."""
        if out is not None and out.dtype != mx_dtype(header.payload_dtype):
            out = out.astype(mx_dtype(header.payload_dtype))
        if out is not None and header.payload_kind == hdr.PAYLOAD_HIDDEN:
            header.payload_shape = tuple(out.shape)  # (a family's layers may widen it)
        if not self.is_last:
            return out
        hdr.set_returned_payload(header)
        if header.payload_kind == hdr.PAYLOAD_NONE:
            return None
        assert out is not None, "a forward step always has an output (zeros if it failed)"
        _, tokens, width = header.payload_shape
        return out[:, -tokens:, :width]

    def _zeros_like_announced(self, header: hdr.StepHeader) -> mx.array | None:
        """A failed step's output: zeros of the shape its layers would have given."""
        shape = hdr.payload_nbytes_shape(header)
        if not shape:
            return None
        if header.payload_kind == hdr.PAYLOAD_HIDDEN and self.shard is not None:
            shape = (*shape[:2], sharding.output_width(self.shard, shape[2]))
        return mx.zeros(shape, dtype=mx_dtype(header.payload_dtype))

    def _act(
        self, header: hdr.StepHeader, payload: mx.array | None, sides: list[mx.array]
    ) -> mx.array | None:
        cmd = header.cmd
        if cmd == hdr.CMD_FORWARD:
            return self._forward(header, payload, sides)
        if cmd == hdr.CMD_LOAD:
            self._load(json.loads(payload_bytes(payload)))
            return payload
        if cmd == hdr.CMD_FREE:
            if self.caches is not None and header.flags & hdr.FLAG_PARK:
                self.caches.park(header.slots)
            elif self.caches is not None:
                self.caches.free(header.slots)
            return payload
        if cmd in (hdr.CMD_UNLOAD, hdr.CMD_SHUTDOWN):
            self._unload()
            return payload
        if cmd == hdr.CMD_PING:
            return payload
        if cmd == hdr.CMD_PROBE:  # (the default split weighs the ranks by these)
            header.lengths[self.rank] = round(speed.probe())
            return payload
        raise StepError(hdr.ERR_BAD_HEADER, f"unknown command {cmd}")

    def _load(self, spec: dict[str, Any]) -> None:
        self._unload()
        start, end = spec["ranges"][self.rank]
        try:
            path = resolve_model(spec["model"], progress=False)
            if sharding.fingerprint(path) != spec["fingerprint"]:
                raise ValueError(
                    f"model at {path} differs from rank 0's (config or weight files differ)"
                )
            tensor = spec.get("tensor", 1)  # (rank 0 chose the layout: pipeline.py)
            if tensor > 1 and (self.tensor is None or self.tensor.size != tensor):
                raise ValueError(f"rank 0 asked for a tensor group of {tensor}: not this rank's")
            memory.check_fits(path, start, end, tensor=tensor)
            kv = spec.get("kv")  # rank 0's KV quantization, not this rank's flags
            group = self.tensor.group if tensor > 1 and self.tensor is not None else None
            self.shard = sharding.load_shard(path, start, end, has_ends=False, kv=kv, tensor=group)
            layout = memory.check_measured(path, start, end, self.shard)
            self.caches = SlotCaches(self.shard)
        except StepError:
            raise
        except memory.ShardTooBig as e:
            raise StepError(hdr.ERR_OUT_OF_MEMORY, str(e)) from e
        except Exception as e:
            raise StepError(hdr.ERR_LOAD, str(e)) from e
        split = f", each split across {tensor} ranks" if tensor > 1 else ""
        log.info("rank %d: loaded layers [%d, %d)%s of %s", self.rank, start, end, split, path)
        proctitle.show_layers(start, end)
        # (the layout of caches measured here, for rank 0's admission check: always
        # sent, so a reload's replaces an earlier model's)
        measured = (
            {"fingerprint": spec["fingerprint"], "layers": [start, end], "layout": layout}
            if layout
            else None
        )
        self.link.send(
            control.LOADED,
            layers=[start, end],
            fingerprint=spec["fingerprint"],
            stats={**memory.stats(), "cache_layout": measured},
        )

    def _unload(self) -> None:
        proctitle.show_layers(None)
        self.shard = None
        self.caches = None
        gc.collect()
        mx.clear_cache()

    def _forward(
        self, header: hdr.StepHeader, payload: mx.array | None, sides: list[mx.array]
    ) -> mx.array:
        if self.shard is None or self.caches is None:
            raise StepError(hdr.ERR_NO_MODEL, "no model loaded on this rank")
        if payload is None or payload.ndim != 3 or payload.shape[0] != header.n_seqs:
            raise StepError(hdr.ERR_BAD_HEADER, f"{header.describe()} has no matching payload")
        try:
            return forward_stage(self.shard, self.caches, header, payload, sides)
        except CacheError as e:
            raise StepError(hdr.ERR_BAD_HEADER, str(e)) from e
