"""A worker's stage: its layers, their slot caches, and what it does with one step.

The loop (loop.py) moves headers and arrays between ranks; this is everything that
happens between receiving a step and passing it on, with no transport in it. So the
loop stays a loop, and tests chain real stages in one process exactly as the ranks run
them (rank 0's `StageRunner`, then each worker's `WorkerStage.take`).

A step never fails here in a way that leaves the ring out of step: whatever goes wrong
while building it (a cache that does not fit the header, a bad shape, a model that will
not load) is caught before anything is sent, flagged in the header it passes on, and
the output is zeros of the announced shape, so every later rank still takes the step.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import traceback
from typing import Any

import mlx.core as mx

from mlx_relay import proctitle
from mlx_relay.model import memory, prefix_store, sharding, speed
from mlx_relay.model.cache_sizes import warm_logged as warm_cache_sizes
from mlx_relay.model.default_model import resolve_model
from mlx_relay.model.kvcache import CacheError, SlotCaches
from mlx_relay.model.stage import forward_stage
from mlx_relay.model.step_inputs import pass_on
from mlx_relay.protocol import header as hdr
from mlx_relay.transport.ring import mx_dtype, payload_bytes
from mlx_relay.transport.tensor import TensorGroup
from mlx_relay.worker.staging import Stager

log = logging.getLogger("mlx_relay.worker")


class StepError(Exception):
    """A step this rank cannot take, with the header's error code for rank 0."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def described(e: Exception) -> str:
    """A step's failure as rank 0 is told it: a StepError's own words, else its type too."""
    return str(e) if isinstance(e, StepError) else f"{type(e).__name__}: {e}"


@dataclasses.dataclass
class Taken:
    """What a stage made of one step, for the loop to send on and report.

    `out`: the payload for the next rank (None where the step carries none); `sides`:
    the side arrays the next ranks need (the header lists them); `failure`: why the
    step failed here (the header is marked, `out` is zeros), for rank 0's error
    message; `loaded`: a LOAD step's report (control.LOADED's fields)."""

    out: mx.array | None
    sides: list[mx.array]
    failure: str | None = None
    loaded: dict[str, Any] | None = None


class WorkerStage:
    """One worker rank's shard and slot caches, and its part of each step rank 0 sends.

    `tensor`: the rank's tensor group, where it has one (every layer split across it).
    `stager`: where CMD_STAGE's files go (--stage-weights; worker/staging.py)."""

    def __init__(
        self,
        rank: int,
        size: int,
        tensor: TensorGroup | None = None,
        stager: Stager | None = None,
    ) -> None:
        self.rank = rank
        self.is_last = rank == size - 1
        self.tensor = tensor
        # the group the loaded model's layers are split across: `tensor`, or with auto
        # its grid of pairs (tensor.pairs), as rank 0's load chose; None for a pipeline
        self.split: TensorGroup | None = None
        self.stager = stager
        self.store: prefix_store.BlockStore | None = None  # --prompt-cache-dir
        self.shard: sharding.Shard | None = None
        self.caches: SlotCaches | None = None

    def _group_of(self, tensor: int) -> TensorGroup | None:
        """This rank's group of `tensor` ranks, for a load rank 0 laid out so: the start's
        group, or auto's grid of pairs (None for 1: a pipeline)."""
        if tensor <= 1:
            return None
        if self.tensor is None or (group := self.tensor.of_size(tensor)) is None:
            raise ValueError(f"rank 0 asked for a tensor group of {tensor}: not this rank's")
        return group

    def timed_group(self, header: hdr.StepHeader) -> TensorGroup | None:
        """The group a CMD_TIME_ALL_SUM times: the whole group, or each pair (FLAG_PAIRS)."""
        if self.tensor is None or not header.flags & hdr.FLAG_PAIRS:
            return self.tensor
        return self.tensor.pairs

    def take(
        self, header: hdr.StepHeader, payload: mx.array | None, sides: list[mx.array]
    ) -> Taken:
        """Act on one step as `header` says; the header is updated in place to what this
        rank passes on (its failure flagged, the side arrays left, what the last rank
        returns). A forward step is only built here, not waited for: the loop posts it
        and the device runs it while the loop already waits for the next header."""
        loaded = failure = None
        try:
            if header.cmd == hdr.CMD_LOAD:
                loaded, out = self.load(json.loads(payload_bytes(payload))), payload
            elif header.cmd == hdr.CMD_STAGE:  # (staged in the background: the step goes on)
                if self.stager is None:
                    raise StepError(hdr.ERR_LOAD, "this rank cannot stage weights")
                self.stager.start(json.loads(payload_bytes(payload)))
                out = payload
            else:
                out = self._act(header, payload, sides)
        except Exception as e:  # noqa: BLE001 - every failure must still complete the step
            code = e.code if isinstance(e, StepError) else hdr.ERR_EXCEPTION
            failure = described(e)
            log.error("rank %d: %s failed: %s", self.rank, header.describe(), failure)
            log.debug("%s", traceback.format_exc())
            header.mark_failed(self.rank, code)
            out = self._zeros_like_announced(header)
        return dataclasses.replace(
            self.passed_on(header, out, sides), failure=failure, loaded=loaded
        )

    def passed_on(
        self, header: hdr.StepHeader, out: mx.array | None, sides: list[mx.array]
    ) -> Taken:
        """What this rank sends on of a step it took (`out`, its output; `sides`, the side
        arrays it received), the header updated to match: the last rank's return, and
        the side arrays later ranks still need (the last rank sends none)."""
        out = self._outgoing(header, out)
        if header.sides:
            layers = len(self.shard.layers) if self.shard is not None else 0
            sides = pass_on(header, sides, layers)
        return Taken(out, sides if header.sides else [])

    def forward(
        self, header: hdr.StepHeader, payload: mx.array | None, sides: list[mx.array]
    ) -> mx.array:
        """This rank's layers on a forward step's input (StepError where it cannot)."""
        if self.shard is None or self.caches is None:
            raise StepError(hdr.ERR_NO_MODEL, "no model loaded on this rank")
        if payload is None or payload.ndim != 3 or payload.shape[0] != header.n_seqs:
            raise StepError(hdr.ERR_BAD_HEADER, f"{header.describe()} has no matching payload")
        try:
            return forward_stage(self.shard, self.caches, header, payload, sides)
        except CacheError as e:
            raise StepError(hdr.ERR_BAD_HEADER, str(e)) from e

    def load(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Load this rank's layers of rank 0's LOAD document (pipeline.py writes it): its
        model (which must be rank 0's, by fingerprint; or, `staged`, the files rank 0
        shipped this rank, by digest), layer ranges, KV settings and layout. Returns the
        report for rank 0 (control.LOADED's fields); StepError with the header's code
        where it cannot."""
        self.unload()
        start, end = spec["ranges"][self.rank]
        staged = bool(spec.get("staged"))
        try:
            if staged:  # (never rank 0's path, even where this machine sees it)
                if self.stager is None:
                    raise ValueError("rank 0 staged weights this rank cannot take")
                path = self.stager.wait()
            else:
                path = resolve_model(spec["model"], progress=False)
                if sharding.fingerprint(path) != spec["fingerprint"]:
                    raise ValueError(
                        f"model at {path} differs from rank 0's (config or weight files differ)"
                    )
            tensor = spec.get("tensor", 1)  # (rank 0 chose the layout: pipeline.py)
            self.split = self._group_of(tensor)
            memory.check_fits(path, start, end, tensor=tensor)
            kv = spec.get("kv")  # rank 0's KV quantization, not this rank's flags
            group = self.split.group if self.split is not None else None
            self.shard = sharding.load_shard(
                path, start, end, has_ends=False, kv=kv, tensor=group, partial=staged
            )
            layout = memory.check_measured(path, start, end, self.shard)
            self.caches = SlotCaches(self.shard)
            warm_cache_sizes(self.shard, path, tensor)
            self.store = prefix_store.open_for(spec, self.rank, self.shard.not_storable)
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
        return {
            "layers": [start, end],
            "fingerprint": spec["fingerprint"],
            "stats": {**memory.stats(), "cache_layout": measured},
        }

    def _blocks(self, header: hdr.StepHeader, document: dict[str, Any]) -> None:
        """CMD_STORE / CMD_RESTORE of the step's slot (SlotCaches.blocks): a store never
        fails (what it cannot write stays in RAM only); a restore that cannot fails the
        step, and rank 0 prefills the prompt instead."""
        if self.caches is None:
            raise StepError(hdr.ERR_NO_MODEL, "no model loaded on this rank")
        restore = header.cmd == hdr.CMD_RESTORE
        try:
            self.caches.blocks(restore, header.slots[0], self.store, document)
        except (prefix_store.StoreError, CacheError) as e:
            raise StepError(hdr.ERR_EXCEPTION, str(e)) from e

    def unload(self) -> None:
        self.store = None
        proctitle.show_layers(None)
        self.shard = None
        self.caches = None
        self.split = None
        gc.collect()
        mx.clear_cache()

    # --- a step's parts ----------------------------------------------------------------
    def _act(
        self, header: hdr.StepHeader, payload: mx.array | None, sides: list[mx.array]
    ) -> mx.array | None:
        cmd = header.cmd
        if cmd == hdr.CMD_FORWARD:
            return self.forward(header, payload, sides)
        if cmd == hdr.CMD_FREE:
            if self.caches is not None and header.flags & hdr.FLAG_PARK:
                self.caches.park(header.slots)
            elif self.caches is not None:
                self.caches.free(header.slots)
            return payload
        if cmd in (hdr.CMD_UNLOAD, hdr.CMD_SHUTDOWN):
            self.unload()
            return payload
        if cmd == hdr.CMD_PING:
            return payload
        if cmd in (hdr.CMD_STORE, hdr.CMD_RESTORE):
            self._blocks(header, json.loads(payload_bytes(payload)))
            return payload
        if cmd == hdr.CMD_PROBE:  # (the default split weighs the ranks by these)
            header.lengths[self.rank] = round(speed.probe())
            return payload
        raise StepError(hdr.ERR_BAD_HEADER, f"unknown command {cmd}")

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
