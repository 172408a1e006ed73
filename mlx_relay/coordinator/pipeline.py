"""Rank 0's end of the ring: run its own stage, send a step around, collect the result.

Every call here is one step that every rank takes in the same order, started by a
header rank 0 wrote. With one rank the ring is empty and the same calls run locally.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_relay import sharding
from mlx_relay.default_model import resolve_model
from mlx_relay.doorbell import DoorbellTimeout
from mlx_relay.launch.hostfile import layer_ranges, split_layers
from mlx_relay.protocol import header as hdr
from mlx_relay.ring import Ring, bytes_payload, dtype_name
from mlx_relay.sidechannel import ControlHub

log = logging.getLogger("mlx_relay.pipeline")


WATCH_INTERVAL_S = 0.1


class RankFailure(RuntimeError):
    """A rank failed inside a step. The ring is still in step; the request is not."""

    def __init__(self, rank: int, host: str, message: str, code: int = hdr.ERR_EXCEPTION):
        where = f"rank {rank}" + (f" ({host})" if host else "")
        super().__init__(f"{where}: {message}")
        self.rank = rank
        self.host = host
        self.code = code


class ClusterFailure(RankFailure):
    """The ring cannot continue: a rank is gone or a step is overdue. Nothing is in step."""

    def __init__(self, rank: int, host: str, message: str) -> None:
        RuntimeError.__init__(
            self,
            (f"rank {rank}" + (f" ({host})" if host else "") + ": " if rank >= 0 else "") + message,
        )
        self.rank = rank
        self.host = host
        self.code = hdr.ERR_EXCEPTION


@dataclass
class LoadedModel:
    spec: str
    path: str
    fingerprint: str
    num_layers: int
    ranges: list[tuple[int, int]]


class Pipeline:
    def __init__(
        self,
        ring: Ring | None,
        hub: ControlHub | None,
        *,
        heartbeat_timeout: float = 3.0,
        step_timeout: float = 0.0,
    ) -> None:
        self.ring = ring
        self.hub = hub
        self.heartbeat_timeout = heartbeat_timeout
        self.step_timeout = step_timeout
        self.world_size = ring.size if ring else 1
        self.shard: sharding.Shard | None = None
        self.loaded: LoadedModel | None = None
        self.caches: dict[int, list[Any]] = {}
        self._step_id = 0

    # --- commands ------------------------------------------------------------------
    def load(self, spec: str, layers: list[int] | None = None) -> LoadedModel:
        """Load `spec` on every rank, each its own layer range; all ranks or none."""
        self.unload()
        path = resolve_model(spec)
        num_layers = sharding.count_layers(sharding.read_config(path))
        counts = layers or split_layers(num_layers, self.world_size)
        if len(counts) != self.world_size or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(
                f"layer split {counts} does not cover {num_layers} layers over "
                f"{self.world_size} ranks with at least one layer each"
            )
        ranges = layer_ranges(counts)
        fp = sharding.fingerprint(path)
        document = {"model": spec, "ranges": ranges, "fingerprint": fp}
        try:
            if self.world_size > 1:
                self._command(hdr.CMD_LOAD, bytes_payload(json.dumps(document).encode()))
            start, end = ranges[0]
            self.shard = sharding.load_shard(path, start, end, has_ends=True)
        except Exception:
            if self.world_size > 1:  # the ranks that did load let go again
                self._command(hdr.CMD_UNLOAD)
            raise
        self.loaded = LoadedModel(spec, str(path), fp, num_layers, [tuple(r) for r in ranges])
        return self.loaded

    def unload(self) -> None:
        if self.loaded is not None and self.world_size > 1:
            self._command(hdr.CMD_UNLOAD)
        self.shard = None
        self.loaded = None
        self.caches.clear()
        mx.clear_cache()

    def free(self, slots: list[int]) -> None:
        for slot in slots:
            self.caches.pop(slot, None)
        if self.world_size > 1 and slots:
            self._command(hdr.CMD_FREE, slots=slots)

    def shutdown(self) -> None:
        """The last step: every worker releases its model and leaves its loop."""
        if self.world_size > 1:
            self._command(hdr.CMD_SHUTDOWN)
        self.shard = None
        self.loaded = None
        self.caches.clear()

    def ping(self) -> float:
        t0 = time.perf_counter()
        if self.world_size > 1:
            self._command(hdr.CMD_PING)
        return time.perf_counter() - t0

    # --- forward -------------------------------------------------------------------
    def forward(
        self, slot: int, offset: int, tokens: list[int], *, want_logits: bool
    ) -> mx.array | None:
        """Run `tokens` of one sequence through every rank; logits of the last position.

        offset 0 starts a fresh KV cache for the slot on every rank.
        """
        shard = self.shard
        if shard is None:
            raise RuntimeError("no model loaded")
        if offset == 0 or slot not in self.caches:
            if offset != 0:
                raise RuntimeError(f"slot {slot} has no cache at position {offset}")
            self.caches[slot] = shard.make_caches()
        h = sharding.run_layers(
            shard, sharding.embed(shard, mx.array(tokens)[None]), self.caches[slot]
        )
        if self.world_size > 1:
            header = hdr.StepHeader(
                cmd=hdr.CMD_FORWARD,
                flags=(hdr.FLAG_WANT_OUTPUT if want_logits else 0)
                | (hdr.FLAG_RESET if offset == 0 else 0),
                payload_kind=hdr.PAYLOAD_HIDDEN,
                payload_dtype=dtype_name(h.dtype),
                payload_shape=tuple(h.shape),
                slots=[slot],
                offsets=[offset],
                lengths=[len(tokens)],
            )
            back, h = self._round_trip(header, h)
            if want_logits and h is None:
                raise RuntimeError(f"{back.describe()} came back without hidden states")
        if not want_logits:
            mx.eval([c.state for c in self.caches[slot]])
            return None
        return sharding.head(shard, h[:, -1:, :])[:, -1, :]

    # --- the ring ------------------------------------------------------------------
    def _command(
        self, cmd: int, payload: mx.array | None = None, slots: list[int] | None = None
    ) -> hdr.StepHeader:
        header = hdr.StepHeader(cmd=cmd, slots=list(slots or []))
        header.offsets = [0] * header.n_seqs
        header.lengths = [0] * header.n_seqs
        if payload is not None:
            header.payload_kind = hdr.PAYLOAD_BYTES
            header.payload_dtype = "uint8"
            header.payload_shape = (payload.size, 0, 0)
        back, _ = self._round_trip(header, payload)
        return back

    def _round_trip(
        self, header: hdr.StepHeader, payload: mx.array | None
    ) -> tuple[hdr.StepHeader, mx.array | None]:
        assert self.ring is not None
        self._step_id += 1
        header.step_id = self._step_id
        self.ring.send(header, payload)
        self._wait_for_return(header)
        back = self.ring.recv_header()
        out = self.ring.recv_payload(back)
        if back.step_id != header.step_id or back.cmd != header.cmd:
            raise hdr.ProtocolError(f"sent {header.describe()}, got back {back.describe()}")
        if back.error_mask:
            raise self._failure(back)
        return back, out

    def _wait_for_return(self, header: hdr.StepHeader) -> None:
        """Sleep until the step comes back, watching every worker's heartbeat meanwhile.

        A worker that died, stopped or lost its link goes silent on the side channel; the
        step is then abandoned with an error naming it instead of waiting forever.
        """
        started = time.monotonic()
        while True:
            try:
                self.ring.wait(timeout=WATCH_INTERVAL_S)
                return
            except DoorbellTimeout:
                pass
            silent = self.hub.silent_ranks(self.heartbeat_timeout) if self.hub else []
            if silent:
                rank = silent[0]
                info = self.hub.snapshot()[rank]
                raise ClusterFailure(
                    rank,
                    info.host,
                    f"no heartbeat for {time.monotonic() - info.last_seen:.1f} s "
                    f"(pid {info.pid}); the rank died, stopped or lost its network",
                )
            elapsed = time.monotonic() - started
            if self.step_timeout and header.cmd == hdr.CMD_FORWARD and elapsed > self.step_timeout:
                raise ClusterFailure(
                    -1, "", f"{header.describe()} overdue after {elapsed:.1f} s (--step-timeout)"
                )

    def _failure(self, back: hdr.StepHeader) -> RankFailure:
        rank = back.failed_ranks[0]
        message = self.hub.take_error(back.step_id, rank) if self.hub else None
        host = ""
        if self.hub is not None:
            info = self.hub.snapshot().get(rank)
            host = info.host if info else ""
        reason = hdr.ERROR_NAMES.get(back.error_code, str(back.error_code))
        return RankFailure(rank, host, message or reason, back.error_code)

    def worker_stats(self) -> dict[int, Any]:
        return self.hub.snapshot() if self.hub else {}


def hub_ready(hub: ControlHub, world_size: int, timeout: float) -> None:
    missing = hub.wait_for_hello(timeout)
    if missing:
        raise RuntimeError(
            f"ranks {missing} never reached rank 0's side channel within {timeout:.0f} s"
        )
    log.info("all %d workers said hello", world_size - 1)
