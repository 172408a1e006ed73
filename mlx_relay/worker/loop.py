"""The worker: receive a step, do exactly what its header says, pass it on.

A worker never samples, never sees text, never decides to stop. Whatever happens
inside a step, it completes the step's communication (zeros of the announced shape
if it failed) and flags the failure in the header it forwards, so the ring never
falls out of step and rank 0 learns what broke.
"""

from __future__ import annotations

import gc
import json
import logging
import traceback
from typing import Any

import mlx.core as mx
import zmq

from mlx_relay import memory, sharding
from mlx_relay.default_model import resolve_model
from mlx_relay.protocol import control
from mlx_relay.protocol import header as hdr
from mlx_relay.ring import Ring, mx_dtype, payload_bytes
from mlx_relay.sidechannel import ControlLink

log = logging.getLogger("mlx_relay.worker")


class StepError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class Worker:
    def __init__(self, ring: Ring, link: ControlLink) -> None:
        self.ring = ring
        self.link = link
        self.rank = ring.rank
        self.is_last = ring.rank == ring.size - 1
        self.shard: sharding.Shard | None = None
        self.caches: dict[int, list[Any]] = {}

    def run(self) -> None:
        """The loop: sleep until a step's doorbell rings, take the step, pass it on."""
        poller = zmq.Poller()
        poller.register(self.ring.doorbell.incoming, zmq.POLLIN)
        poller.register(self.link.socket, zmq.POLLIN)
        while True:
            self.link.state = "waiting"
            events = dict(poller.poll())
            if self.link.socket in events and self.link.bye_received():
                log.info("rank %d: rank 0 said bye", self.rank)
                return
            if self.ring.doorbell.incoming not in events:
                continue
            self.ring.wait(timeout=0)
            self.link.state = "busy"
            header = self.ring.recv_header()
            payload = self.ring.recv_payload(header)
            out = self.step(header, payload)
            self.ring.send(header, out)
            if header.cmd == hdr.CMD_SHUTDOWN:
                log.info("rank %d: shutdown", self.rank)
                return

    def step(self, header: hdr.StepHeader, payload: mx.array | None) -> mx.array | None:
        """Act on one step; returns the payload to forward (the header is updated in place)."""
        try:
            out = self._act(header, payload)
            if out is not None:
                mx.eval(out)
        except Exception as e:  # noqa: BLE001 - every failure must still complete the step
            code = e.code if isinstance(e, StepError) else hdr.ERR_EXCEPTION
            message = f"{type(e).__name__}: {e}"
            log.error("rank %d: %s failed: %s", self.rank, header.describe(), message)
            log.debug("%s", traceback.format_exc())
            header.mark_failed(self.rank, code)
            self.link.send(control.ERROR, step_id=header.step_id, message=message)
            out = self._zeros_like_announced(header)
        return self._outgoing(header, out)

    def _outgoing(self, header: hdr.StepHeader, out: mx.array | None) -> mx.array | None:
        """The last rank returns hidden states only when rank 0 asked for them."""
        if self.is_last and not (
            header.cmd == hdr.CMD_FORWARD and header.flags & hdr.FLAG_WANT_OUTPUT
        ):
            header.payload_kind = hdr.PAYLOAD_NONE
            header.payload_shape = (0, 0, 0)
            return None
        return out

    def _zeros_like_announced(self, header: hdr.StepHeader) -> mx.array | None:
        shape = hdr.payload_nbytes_shape(header)
        if not shape:
            return None
        return mx.zeros(shape, dtype=mx_dtype(header.payload_dtype))

    def _act(self, header: hdr.StepHeader, payload: mx.array | None) -> mx.array | None:
        cmd = header.cmd
        if cmd == hdr.CMD_FORWARD:
            return self._forward(header, payload)
        if cmd == hdr.CMD_LOAD:
            self._load(json.loads(payload_bytes(payload)))
            return payload
        if cmd == hdr.CMD_FREE:
            for slot in header.slots:
                self.caches.pop(slot, None)
            return payload
        if cmd in (hdr.CMD_UNLOAD, hdr.CMD_SHUTDOWN):
            self._unload()
            return payload
        if cmd == hdr.CMD_PING:
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
            self.shard = sharding.load_shard(path, start, end, has_ends=False)
        except Exception as e:
            raise StepError(hdr.ERR_LOAD, str(e)) from e
        log.info("rank %d: loaded layers [%d, %d) of %s", self.rank, start, end, path)
        self.link.send(
            control.LOADED,
            layers=[start, end],
            fingerprint=spec["fingerprint"],
            stats=memory.stats(),
        )

    def _unload(self) -> None:
        self.shard = None
        self.caches.clear()
        gc.collect()
        mx.clear_cache()

    def _forward(self, header: hdr.StepHeader, payload: mx.array | None) -> mx.array:
        if self.shard is None:
            raise StepError(hdr.ERR_NO_MODEL, "no model loaded on this rank")
        if payload is None or payload.ndim != 3 or payload.shape[0] != header.n_seqs:
            raise StepError(hdr.ERR_BAD_HEADER, f"{header.describe()} has no matching payload")
        outputs = []
        for i, (slot, offset, length) in enumerate(
            zip(header.slots, header.offsets, header.lengths, strict=True)
        ):
            caches = self._caches_for(slot, offset, reset=bool(header.flags & hdr.FLAG_RESET))
            h = sharding.run_layers(self.shard, payload[i : i + 1, :length], caches)
            if length < payload.shape[1]:
                pad = mx.zeros((1, payload.shape[1] - length, h.shape[-1]), dtype=h.dtype)
                h = mx.concatenate([h, pad], axis=1)
            outputs.append(h)
        return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=0)

    def _caches_for(self, slot: int, offset: int, reset: bool) -> list[Any]:
        if reset or offset == 0:
            self.caches[slot] = sharding.new_caches(self.shard)
        caches = self.caches.get(slot)
        if caches is None:
            raise StepError(hdr.ERR_BAD_HEADER, f"slot {slot} has no cache at position {offset}")
        if caches and caches[0].offset != offset:
            raise StepError(
                hdr.ERR_BAD_HEADER,
                f"slot {slot} is at position {caches[0].offset}, step says {offset}",
            )
        return caches
