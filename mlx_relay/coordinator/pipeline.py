"""Rank 0's end of the ring: run its own stage, send a step around, collect the result.

Every call here is one step that every rank takes in the same order, started by a
header rank 0 wrote. Steps are *launched* and later *completed* in FIFO order, so
several can be in flight around the ring at once: while rank 1 works on one decode
group, rank 0 already runs its layers for the next. Commands (load, unload, shutdown)
wait until nothing is in flight. With one rank the ring is empty and the same calls
run locally.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_relay import timeline
from mlx_relay.coordinator.mailboxes import Mailboxes
from mlx_relay.coordinator.pace import StepPace, step_cost
from mlx_relay.coordinator.ring_watch import ClusterFailure, RankFailure, RingWatch
from mlx_relay.model import memory, sharding, speed
from mlx_relay.model.default_model import resolve_model
from mlx_relay.model.kvcache import CacheError, SlotCaches
from mlx_relay.model.speed import speed_weights
from mlx_relay.model.split import (
    AUTO,
    default_split,
    keep_kv_shared_together,
    layer_costs,
    layer_ranges,
    memory_split,
)
from mlx_relay.model.stage import forward_stage
from mlx_relay.model.step_inputs import PromptInputs, pass_on
from mlx_relay.protocol import control
from mlx_relay.protocol import header as hdr
from mlx_relay.transport.doorbell import DoorbellTimeout, NeighbourGone
from mlx_relay.transport.hub import ControlHub, LinkFailure
from mlx_relay.transport.ring import Ring, bytes_payload, dtype_name, mx_dtype, payload_nbytes

log = logging.getLogger("mlx_relay.pipeline")


WATCH_INTERVAL_S = 0.1


@dataclass
class Step:
    """A step launched round the ring, completed later in launch order.

    Launching posts rank 0's part; announcing sends it on (header on the doorbell,
    payload on the ring): at once with eager hops, else once computed. Completing takes
    the header back and the payload's receive (posted at launch with eager hops, else
    now), giving the logits as a graph still to be computed: the caller posts what
    depends on them (the next step) before it reads them, so the device never idles
    while the host waits.
    """

    header: hdr.StepHeader
    want_logits: bool
    hidden: mx.array | None = None
    posted: Any = None  # the payload's (and side arrays') sends in flight, kept alive
    returned: mx.array | None = None  # eager hops: the return's receive, posted at launch
    launched_at: float = field(default_factory=time.monotonic)
    tag: Any = None  # the engine's own bookkeeping
    units: float = 0.0  # a forward step's work (pace.step_cost)
    took: float = 0.0  # seconds from when it could start to done with (see pace.py)
    sides: list[mx.array] = field(default_factory=list)  # sent after the payload


def _second_lap_header(first: hdr.StepHeader) -> hdr.StepHeader:
    """The header of a step's second lap (its first: FLAG_FIRST_LAP): the same rows and
    positions, on the caches the first lap left (no reuse to start from again)."""
    flags = first.flags & ~(hdr.FLAG_FIRST_LAP | hdr.FLAG_REUSE) | hdr.FLAG_SECOND_LAP
    return dataclasses.replace(
        first,
        flags=flags,
        step_id=0,
        slots=list(first.slots),
        offsets=list(first.offsets),
        lengths=list(first.lengths),
        deltas=list(first.deltas),
        sides=[],
    )


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
        steps_in_flight: int = 0,
    ) -> None:
        self.ring = ring
        self.hub = hub
        self.heartbeat_timeout = heartbeat_timeout
        self.step_timeout = step_timeout
        self._hidden = 0  # the loaded model's hidden size (what context costs)
        self.world_size = ring.size if ring else 1
        # Which steps are out, their deadlines, and whom to name when one is late.
        self.watch = RingWatch(
            hub,
            self.world_size,
            heartbeat_timeout=heartbeat_timeout,
            step_timeout=step_timeout,
            eager=ring is not None and ring.eager,
        )
        # Steps round the ring at once (0: one a rank). More than one a rank keeps a
        # rank's device busy while its host waits for a return and launches what reads it.
        self.depth = steps_in_flight if steps_in_flight and self.world_size > 1 else self.world_size
        self.shard: sharding.Shard | None = None
        self.loaded: LoadedModel | None = None
        self.caches: SlotCaches | None = None
        self._in_flight: deque[Step] = deque()
        self._step_id = 0
        self._unannounced: deque[tuple[Step, mx.array | None]] = deque()
        # Frees asked for while a two-pass model's first lap is round the ring: they go
        # after its second lap, here and on the ring (see launch_free).
        self._deferred: deque[tuple[Step | None, list[int], bool]] = deque()
        # Returns received but not yet settled (CUDA, see settle): what reads them is
        # built meanwhile and launched only after settle.
        self._unsettled: list[mx.array] = []
        # READY hops on the CPU: returns not yet read, each with the evaluated array its
        # bytes will be written into (complete(early=True), settle), oldest first; and
        # the failures settle found in them, for the engine to take (failure_of).
        self._early: list[tuple[Step, mx.array]] = []
        self._boxes = Mailboxes(keep=self.depth + 1)  # (what _early's are taken from)
        self._early_failures: dict[int, RankFailure] = {}
        # slot -> its sequence's position delta (multimodal rope: set by its prompt's
        # positions, every later step's header carries it); empty for other models
        self._deltas: dict[int, int] = {}
        self._per_layer = False  # the model's layers take per-layer inputs (gemma4 2B/4B)

    # --- commands ------------------------------------------------------------------
    @property
    def hidden_size(self) -> int:
        """The loaded model's hidden size (0: none loaded), for costing steps (pace.py)."""
        return self._hidden

    def load(self, spec: str, layers: list[int] | str | None = None) -> LoadedModel:
        """Load `spec` on every rank, each its own layer range; all ranks or none."""
        self.unload()
        path = resolve_model(spec)
        num_layers = sharding.count_layers(sharding.read_config(path))
        counts, computed = self._plan_split(path, num_layers, layers)
        if len(counts) != self.world_size or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(
                f"layer split {counts} does not cover {num_layers} layers over "
                f"{self.world_size} ranks with at least one layer each"
            )
        counts = keep_kv_shared_together(path, list(counts), computed)
        ranges = layer_ranges(counts)
        try:  # before any worker loads: rank 0 holds the embedding and LM head too
            memory.check_fits(path, *ranges[0], ends=True)
        except memory.ShardTooBig as e:
            raise RankFailure(0, control.host_name(), str(e), hdr.ERR_OUT_OF_MEMORY) from e
        fp = sharding.fingerprint(path)
        kv = memory.plan().kv_quantization()  # quantized KV caches: the same on every rank
        document = {"model": spec, "ranges": ranges, "fingerprint": fp, "kv": kv}
        try:
            if self.world_size > 1:
                self._command(hdr.CMD_LOAD, bytes_payload(json.dumps(document).encode()))
            start, end = ranges[0]
            self.shard = sharding.load_shard(path, start, end, has_ends=True, kv=kv)
            try:
                memory.check_measured(path, start, end, self.shard, ends=True)
            except memory.ShardTooBig as e:
                host = control.host_name()
                raise RankFailure(0, host, str(e), hdr.ERR_OUT_OF_MEMORY) from e
            self.caches = SlotCaches(self.shard)
            self._per_layer = sharding.computes_per_layer_inputs(self.shard)
        except Exception:
            if self.world_size > 1:  # the ranks that did load let go again
                self._command(hdr.CMD_UNLOAD)
            raise
        self._hidden = sharding.hidden_size(self.shard.config)
        self.watch.reset()  # (a new model: its pace is still to be measured)
        self.loaded = LoadedModel(spec, str(path), fp, num_layers, [tuple(r) for r in ranges])
        return self.loaded

    def _plan_split(
        self, path: Any, num_layers: int, layers: list[int] | str | None
    ) -> tuple[list[int], bool]:
        """The layer counts to load, and whether they were computed here (by memory or
        by speed; named splits arrive as counts that keep a KV-shared tail already).

        The default: equal work per rank, rank 0's LM head counted (the fastest split
        under load in bench_concurrency; single-stream speed does not depend on it),
        where the ranks are equally fast; else work in proportion to each rank's
        measured speed (`probe_speeds`), unless that would not fit a rank's memory, when
        the split by memory (`auto`) is taken instead."""
        if layers and layers != AUTO:
            return list(layers), False
        config = sharding.read_config(path)
        costs = layer_costs(path, num_layers, config)
        stats = self._rank_stats()
        if layers == AUTO:
            return memory_split(num_layers, stats, costs), True
        weights = speed_weights(self.probe_speeds())
        counts = default_split(path, num_layers, self.world_size, weights)
        if weights is None:
            return counts, False
        rooms = [None if figures is None else memory.headroom(figures) for figures in stats]
        short = memory.short_rank(path, layer_ranges(counts), rooms)
        if short is not None:
            log.info("layers by speed %s do not fit rank %d's memory: by memory", counts, short)
            return memory_split(num_layers, stats, costs), True
        log.info("layers by speed: %s MB/s per rank -> layers %s", weights, counts)
        return counts, True

    def _rank_stats(self) -> list[dict[str, Any] | None]:
        """Every rank's memory figures: rank 0's own, each worker's latest report."""
        snapshot = self.hub.snapshot() if self.hub is not None else {}
        workers = [snapshot[r].stats if r in snapshot else None for r in range(1, self.world_size)]
        return [memory.stats(), *workers]

    def probe_speeds(self) -> list[float] | None:
        """Each rank's weight-reading speed in MB/s (model/speed.py), measured one rank
        after another: rank 0 here, then each worker as CMD_PROBE passes it, writing its
        figure into the header's `lengths` at its rank. Ranks of one machine (the same
        host name) are equally fast: each counts as the fastest of them, so what else
        runs there does not tell them apart. None where all ranks share one machine
        (nothing is measured), with one rank, or more ranks than a header has rows."""
        hosts = [control.host_name(), *(self.watch.host(r) for r in range(1, self.world_size))]
        if len(set(hosts)) < 2 or self.world_size > hdr.MAX_SEQS:
            return None
        own = speed.probe()
        back = self._command(hdr.CMD_PROBE, slots=list(range(self.world_size)))
        measured = [own, *(float(v) for v in back.lengths[1:])]
        best = {h: max(m for m, o in zip(measured, hosts, strict=True) if o == h) for h in hosts}
        return [best[h] for h in hosts]

    def unload(self) -> None:
        if self.loaded is not None and self.world_size > 1:
            self._command(hdr.CMD_UNLOAD)
        self.shard = None
        self.loaded = None
        self.caches = None
        self._deltas.clear()
        self._per_layer = False
        self._boxes.clear()
        mx.clear_cache()

    def shutdown(self) -> None:
        """The last step: every worker releases its model and leaves its loop."""
        if self.world_size > 1:
            if self.hub is not None:
                self.hub.expect_exits()
            self._command(hdr.CMD_SHUTDOWN)
        self.shard = None
        self.loaded = None
        self.caches = None

    # --- steps in flight -----------------------------------------------------------
    def launch_forward(
        self,
        slots: list[int],
        offsets: list[int],
        tokens: mx.array,
        lengths: list[int],
        *,
        group: int = hdr.NO_GROUP,
        want_logits: bool,
        reuse_from: int | None = None,
        prompt: PromptInputs | None = None,
        all_positions: bool = False,
    ) -> Step:
        """Post rank 0's layers for one step and send it round the ring.

        `tokens` (batch, width) may still be on its way (the sampled tokens of the step
        before): nothing here waits for it. A decode group (one token per sequence)
        runs as one batch; otherwise each sequence (a prefill chunk, right-padded to
        the widest) runs alone on its own cache. `reuse_from`: the one sequence starts
        from that slot's parked cache, cut back to its offset. `prompt`: a prefill
        chunk's input embeddings (1, width, hidden), used instead of embedding `tokens`
        (an image request's prompt, with the image features merged in on rank 0), and
        for a multimodal-rope model its positions, sent round as a side array, and its
        sequence's position delta, which every later step of the slot carries.
        `all_positions`: the step's one sequence wants logits at every position it
        carries (a speculative verify step), not only at its last.
        """
        if self.shard is None or self.caches is None:
            raise RuntimeError("no model loaded")
        timeline.mark("build", self._step_id + 1, sum(lengths))  # (the id _launch gives it)
        header = hdr.StepHeader(
            cmd=hdr.CMD_FORWARD,
            flags=(hdr.FLAG_WANT_OUTPUT if want_logits else 0)
            | (hdr.FLAG_REUSE if reuse_from is not None else 0)
            | (hdr.FLAG_ALL_POSITIONS if all_positions else 0),
            group=group,
            slots=list(slots),
            offsets=list(offsets),
            lengths=list(lengths),
            source=hdr.NO_SOURCE if reuse_from is None else reuse_from,
        )
        # (side inputs: only a multimodal-rope model's image prompts and later steps)
        sides = self._side_inputs(header, prompt) if prompt is not None or self._deltas else []
        if prompt is not None:
            h = prompt.embeddings
        elif sharding.embeds_ids(self.shard):  # (each row's earlier ids too)
            h = self._embed_with_ids(slots, offsets, tokens, lengths, reuse_from)
        else:
            h = sharding.embed(self.shard, tokens, offsets)
        if self._per_layer:  # gemma4's per-layer inputs: every step, from the token ids
            ids_part = prompt.per_layer if prompt is not None else None  # (an image's)
            per_layer = sharding.per_layer_inputs(self.shard, tokens, h, ids_part)
            header.sides.append(
                hdr.SideArray(
                    hdr.SIDE_PER_LAYER, dtype_name(per_layer.dtype), tuple(per_layer.shape)
                )
            )
            sides.append(per_layer)
        if self.shard.passes == 2:  # (IQuest Loop Coder: the ring twice, see _second_lap)
            header.flags |= hdr.FLAG_FIRST_LAP
        try:
            h = forward_stage(self.shard, self.caches, header, h, sides)
            if self.shard.passes == 2 and self.world_size == 1:  # (both passes here)
                h = forward_stage(self.shard, self.caches, _second_lap_header(header), h)
        except CacheError as e:
            raise RuntimeError(f"rank 0: {e}") from e
        if sides:  # (what the next ranks need of them)
            sides = pass_on(header, sides, len(self.shard.layers))
        step = Step(header, want_logits, sides=sides)
        step.units = step_cost(lengths, offsets, self._hidden)
        if self.world_size == 1:
            step.hidden = h[:, -1:, :] if want_logits and not all_positions else h
            mx.async_eval(tokens)  # (first, apart: see _launch)
            mx.async_eval(step.hidden)
            self._step_id += 1  # (numbered as on a ring, for timeline and logs)
            header.step_id = self._step_id
            timeline.mark("posted", header.step_id)
            return step
        header.payload_kind = hdr.PAYLOAD_HIDDEN
        header.payload_dtype = dtype_name(h.dtype)
        header.payload_shape = tuple(h.shape)
        self._launch(step, h, tokens)
        return step

    def _embed_with_ids(
        self,
        slots: list[int],
        offsets: list[int],
        tokens: mx.array,
        lengths: list[int],
        reuse_from: int | None,
    ) -> mx.array:
        """The embedding of a family that reads each sequence's earlier ids (LongCat
        Flash's n-gram embedding), which the slot caches keep from step to step."""
        assert self.caches is not None
        before = [
            self.caches.ids_before(slot, offset, reuse_from)
            for slot, offset in zip(slots, offsets, strict=True)
        ]
        h = sharding.embed(self.shard, tokens, offsets, before)
        for i, (slot, length) in enumerate(zip(slots, lengths, strict=True)):
            self.caches.record_ids(slot, before[i], tokens[i : i + 1, :length])
        return h

    def _side_inputs(self, header: hdr.StepHeader, prompt: PromptInputs | None) -> list[mx.array]:
        """The step's side arrays, listed in `header`, and its sequences' deltas."""
        if prompt is not None and prompt.positions is not None:
            (slot,) = header.slots  # a prefill chunk: one sequence
            self._deltas[slot] = prompt.delta
            positions = prompt.positions.astype(mx.int32)
            header.sides = [hdr.SideArray(hdr.SIDE_POSITIONS, "int32", tuple(positions.shape))]
            header.deltas = [prompt.delta]
            return [positions]
        if prompt is not None and prompt.token_types is not None:  # gemma4's image mask
            types = prompt.token_types.astype(mx.int32)
            header.sides = [hdr.SideArray(hdr.SIDE_TOKEN_TYPES, "int32", tuple(types.shape))]
            return [types]
        if self._deltas:  # a multimodal-rope model with an image request running
            if header.group == hdr.NO_GROUP:  # a text prompt in the slot starts afresh
                for slot in header.slots:
                    self._deltas.pop(slot, None)
            deltas = [self._deltas.get(slot, 0) for slot in header.slots]
            header.deltas = deltas if any(deltas) else []
        return []

    def launch_free(self, slots: list[int], park: bool = False) -> Step | None:
        """Drop the slots' caches (or, with `park`, keep each as a single sequence's for
        a later prefix reuse) here now and on every worker when the step reaches it.

        While a two-pass model's first lap is round the ring, its second lap (launched
        when the first comes back) still needs the caches of its slots, here and on the
        ring: the free waits for it, and goes right after it (`_release_deferred`)."""
        step = None
        if self.world_size > 1 and slots and self.shard is not None:
            header = hdr.StepHeader(
                cmd=hdr.CMD_FREE, flags=hdr.FLAG_PARK if park else 0, slots=list(slots)
            )
            header.offsets = header.lengths = [0] * len(slots)
            step = Step(header, want_logits=False)
        if self._first_lap_in_flight():
            self._deferred.append((step, slots, park))
        else:
            self._release_deferred()  # (any still waiting go first, in order)
            self._free(step, slots, park)
        return step

    def _first_lap_in_flight(self) -> bool:
        return any(s.header.flags & hdr.FLAG_FIRST_LAP for s in self._in_flight)

    def _free(self, step: Step | None, slots: list[int], park: bool) -> None:
        for slot in slots if self._deltas else ():
            self._deltas.pop(slot, None)
        if self.caches is not None:
            (self.caches.park if park else self.caches.free)(slots)
        if step is not None:
            self._launch(step, None)

    def _release_deferred(self) -> None:
        """The frees that waited for a second lap (launch_free), in order."""
        waiting = list(self._deferred)
        self._deferred.clear()
        for step, slots, park in waiting:
            self._free(step, slots, park)

    def complete(self, step: Step, *, early: bool = False) -> mx.array | None:
        """Take the oldest step in flight back: its logits (batch, vocab) if it asked for
        them, as a graph still to be computed. RankFailure if a rank failed it.

        `early` (READY hops on the CPU, a step that wants logits): return them before the
        step has come back, built on a mailbox that `settle` fills with what returns, so
        the caller builds the next step (sampling, embedding, rank 0's layers) while the
        other ranks compute, and evaluates nothing that reads them before `settle`. A
        rank's failure of the step then comes from `failure_of` after the settle."""
        if self.world_size > 1:
            if any(deferred is step for deferred, _, _ in self._deferred):
                self._release_deferred()  # (its first lap failed: no second lap came)
            if not self._in_flight or self._in_flight[0] is not step:
                raise RuntimeError("steps must complete in the order they were launched")
            self._in_flight.popleft()
            self.announce()
            step.posted = None
            if early and self._returns_early(step):
                step.hidden = self._mailbox(step)
                return self._logits(step)
            self._settle_early()  # (returns come back in launch order)
            _, step.hidden = self._receive(step)
            if step.header.flags & hdr.FLAG_FIRST_LAP:
                return self._second_lap(step)
        if not step.want_logits:
            self.settle()
            mx.eval(step.hidden)  # computed on every rank when this returns: it is timed
            return None
        return self._logits(step)

    def _logits(self, step: Step) -> mx.array:
        """The LM head on what came back: each row's last position (batch, vocab), or
        for a verify step (FLAG_ALL_POSITIONS) its one row's every position (tokens, vocab)."""
        if step.header.flags & hdr.FLAG_ALL_POSITIONS:
            return sharding.head(self.shard, step.hidden)[0]
        return sharding.head(self.shard, step.hidden)[:, -1, :]

    def _returns_early(self, step: Step) -> bool:
        """Whether `step`'s return can be built on before it came (see complete), for a
        step that wants logits and goes round once: one that returns inline (ADAPTIVE
        hops under load: its bytes come in the header's message), or any with READY hops
        on the CPU device (its payload comes computed, into memory the host can write)."""
        return (
            step.want_logits
            and not step.header.flags & hdr.FLAG_FIRST_LAP
            and (
                self.ring.returns_inline(step.header)
                or (not self.ring.eager and mx.default_device() == mx.cpu)
            )
        )

    def _mailbox(self, step: Step) -> mx.array:
        """The return of `step` as it will be, for graphs to be built on: a view of an
        evaluated byte array that `_settle_early` fills (MLX arrays read through their
        buffer what a NumPy view of it wrote)."""
        back = hdr.returned(step.header, self._returned_width(step.header))
        box = self._boxes.take(payload_nbytes(back))
        self._early.append((step, box))
        return box.view(mx_dtype(back.payload_dtype)).reshape(hdr.payload_nbytes_shape(back))

    def _settle_early(self) -> None:
        """Read the returns `complete(early=True)` handed out, oldest first, into their
        mailboxes. A rank's failure of one is kept for `failure_of` (its mailbox keeps
        zeros, and what was built on it is ignored); a broken cluster raises."""
        while self._early:
            step, box = self._early.pop(0)
            try:
                _, out = self._receive(step, host_bytes=True)
            except RankFailure as e:
                if isinstance(e, ClusterFailure):
                    self._early.clear()
                    raise
                if self.watch.is_out(step.header.step_id):  # (else nobody reads it)
                    self._early_failures[step.header.step_id] = e
                else:
                    log.warning("dropped %s: %s", step.header.describe(), e)
                continue
            if isinstance(out, np.ndarray):  # (an inline return's bytes)
                np.array(box, copy=False)[:] = out
                continue
            data = out.view(mx.uint8).reshape(-1)
            mx.eval(data)
            np.array(box, copy=False)[:] = np.array(data, copy=False)

    def failure_of(self, step: Step) -> RankFailure | None:
        """A rank's failure of `step`, found when its early return was settled."""
        return self._early_failures.pop(step.header.step_id, None)

    def _second_lap(self, step: Step) -> mx.array | None:
        """A two-pass model's step (Shard.passes) after its first lap came back with
        every position: rank 0 runs its layers' second pass on them and sends the step
        round again; what that lap returns is the step's. Only one step is in flight for
        such a model (in_flight_limit), so the second lap follows its first directly."""
        assert self.shard is not None and self.caches is not None and step.hidden is not None
        header = _second_lap_header(step.header)
        try:
            h = forward_stage(self.shard, self.caches, header, step.hidden)
        except CacheError as e:
            raise RuntimeError(f"rank 0: {e}") from e
        header.payload_shape = tuple(h.shape)
        lap = Step(header, step.want_logits)
        self._launch(lap, h)
        self._release_deferred()
        try:
            return self.complete(lap)
        finally:
            self.done(lap)

    @property
    def in_flight_limit(self) -> int:
        """How many steps may be round the ring at once: `depth`, or one for a model
        whose steps go round twice (the second lap starts from the first's return)."""
        if self.shard is not None and self.shard.passes == 2:
            return 1
        return self.depth

    def complete_all(self) -> None:
        """Let every step in flight come back (before a command, or when giving up)."""
        while self._in_flight or self._deferred:
            if not self._in_flight:
                self._release_deferred()
                continue
            step = self._in_flight[0]
            try:
                self.complete(step)
            except RankFailure as e:
                if isinstance(e, ClusterFailure):
                    raise
                log.warning("dropped %s: %s", step.header.describe(), e)
            finally:
                self.done(step)

    # --- the ring ------------------------------------------------------------------
    @property
    def unsettled(self) -> bool:
        """Whether a return is still to be settled before what reads it is launched."""
        return bool(self._unsettled or self._early)

    def settle(self) -> None:
        """Wait for the returns received since the last launch (on CUDA; see Ring), and
        read those handed out early (READY hops on the CPU; see complete): the last thing
        before launching what reads them, so rank 0 builds its next step (head,
        sampling, embedding, its layers) while the return is still on its way, instead
        of after it arrived."""
        if not self.unsettled:
            return
        timeline.mark("settle", self._step_id + 1)
        self._settle_early()
        if self._unsettled:
            self.ring.settle(*self._unsettled)
            self._unsettled.clear()
        timeline.mark("return_settled", self._step_id + 1)

    def _launch(self, step: Step, payload: mx.array | None, tokens: mx.array | None = None) -> None:
        """Post rank 0's part of the step and, with eager hops, send it on and post the
        receive of what comes back; otherwise `announce` sends it once it is computed.

        The step's input `tokens` (sampled from the last return, not read yet) are
        posted first, on their own: MLX gives every array of one evaluation one event,
        signalled once all of it has run, so posted with rank 0's layers they could be
        read only after those, and the engine thread, reading them, took the next
        return that much later (7 ms of a 21 ms period under load on two H100s)."""
        self.settle()
        if tokens is not None:
            mx.async_eval(tokens)
        if self._deferred and not step.header.flags & hdr.FLAG_SECOND_LAP:
            if not self._first_lap_in_flight():  # (frees that waited for a first lap
                self._release_deferred()  # that failed go before anything later)
        self._step_id += 1
        step.header.step_id = self._step_id
        if tokens is not None:
            timeline.mark_when_computed("sampled", step.header.step_id, tokens)
        self.watch.launched(step)
        width = self._returned_width(step.header)
        # (a prompt's chunk before its last wants no logits and its next chunk follows at
        # once: it is never alone, so its return stays off the GPU streams. With an
        # all-sum back on two H100s, rank 0's next chunk waited for the first one's whole
        # trip round the ring: 4 ranks began flowing only after ~80 ms.)
        alone = not self._in_flight and step.want_logits
        self.ring.choose_path(step.header, alone=alone, returned_width=width)
        self._in_flight.append(step)
        if not self.ring.eager:
            if payload is not None:
                mx.async_eval(payload)
            self._unannounced.append((step, payload))
            return
        back = hdr.returned(step.header, width)
        if payload is not None:  # (the device has rank 0's part; `sent`: and its hop out)
            timeline.mark_when_computed("computed", step.header.step_id, payload)
        try:
            step.posted = self.ring.send(step.header, payload, step.sides)
            if payload is not None:
                timeline.mark_when_computed("sent", step.header.step_id, payload)
            if not self.ring.returns_inline(step.header):
                step.returned = self.ring.post_recv_payload(back)
        except RuntimeError as e:
            # The header is out: whatever failed, the ring is no longer in step.
            broken = self.watch.ring_broken(e, self.ring.next)
            if isinstance(broken, ClusterFailure):
                raise broken from e
            raise ClusterFailure(
                -1, "", f"rank 0 could not post {step.header.describe()}: {e}"
            ) from e

    def announce(self) -> None:
        """Send on every launched step, in launch order, each once its payload is
        computed. The engine calls this after it has streamed the tokens it had, so that
        work overlaps the device's; nothing comes back before its step was announced."""
        while self._unannounced:
            step, payload = self._unannounced.popleft()
            try:
                step.posted = self.ring.send(step.header, payload, step.sides)
            except RuntimeError as e:
                raise self.watch.ring_broken(e, self.ring.next) from e

    def _command(
        self, cmd: int, payload: mx.array | None = None, slots: list[int] | None = None
    ) -> hdr.StepHeader:
        self.complete_all()
        header = hdr.StepHeader(cmd=cmd, slots=list(slots or []))
        header.offsets = [0] * header.n_seqs
        header.lengths = [0] * header.n_seqs
        if payload is not None:
            header.payload_kind = hdr.PAYLOAD_BYTES
            header.payload_dtype = "uint8"
            header.payload_shape = (payload.size, 0, 0)
        step = Step(header, want_logits=False)
        self._launch(step, payload)
        self._in_flight.popleft()
        try:
            self.announce()
            back, out = self._receive(step)
            self.settle()
            if out is not None:
                mx.eval(out)
        finally:
            self.done(step)  # failed or not: nothing more will come of it
        return back

    def _returned_width(self, header: hdr.StepHeader) -> int | None:
        """The width of the state the last rank sends back for a forward step: what the
        model's last layer leaves (wider than what rank 0 sent where the layers widen
        it: Kimi K3's attention residuals); None for anything else."""
        if header.payload_kind != hdr.PAYLOAD_HIDDEN or self.shard is None:
            return None
        return sharding.output_width(self.shard, header.payload_shape[2], self.shard.num_layers)

    def _receive(self, step: Step, host_bytes: bool = False) -> tuple[hdr.StepHeader, Any]:
        """The header that came back, and the receive of its payload, posted (with
        `host_bytes`, an inline payload as its bytes, a NumPy uint8 array). A failed
        step's payload (zeros) is received all the same, so the ring stays in step."""
        header = step.header
        back = self._wait_for_return(step)
        timeline.mark("returned", back.step_id)
        shape = hdr.payload_nbytes_shape(back)
        if (
            back.step_id != header.step_id
            or back.cmd != header.cmd
            or (back.flags ^ header.flags) & hdr.FLAGS_COLLECTIVE
            or shape != hdr.payload_nbytes_shape(hdr.returned(header, self._returned_width(header)))
        ):
            raise ClusterFailure(
                -1, "", f"ranks out of step: sent {header.describe()}, got {back.describe()}"
            )
        out, step.returned = step.returned, None
        if host_bytes and back.flags & hdr.FLAG_INLINE:
            out = self.ring.take_inline_bytes(back)
        elif not self.ring.eager or self.ring.returns_inline(header):
            try:
                out = self.ring.post_recv_payload(back)
            except RuntimeError as e:
                raise self.watch.ring_broken(e, self.ring.prev) from e
        if back.error_mask:
            raise self.watch.failure(back)
        if (
            isinstance(out, mx.array)
            and self.ring.settles
            and not self.ring.receives_collectively(header)
            and not back.flags & hdr.FLAG_INLINE  # (its bytes came with the header)
        ):
            self._unsettled.append(out)  # (CUDA: settled right before what reads it launches)
        return back, out

    def _wait_for_return(self, step: Step) -> hdr.StepHeader:
        """Sleep until the step's header comes back, watching every worker's heartbeat.

        A worker that died, stopped or lost its link goes silent on the side channel; the
        step is then abandoned with an error naming it instead of waiting forever.
        """
        while True:
            try:
                return self.ring.recv_header(timeout=WATCH_INTERVAL_S)
            except DoorbellTimeout:
                pass
            except NeighbourGone as e:
                raise self.watch.ring_broken(e, self.ring.prev) from e
            gone = self.watch.gone()
            if gone:
                raise gone
            overdue = self.watch.overdue(step)
            if overdue:
                raise overdue

    def done(self, step: Step) -> None:
        """The caller has what it wanted of `step` (its results were read): the ring's
        pace learns what a forward step that came back whole took."""
        failed = self._early_failures.pop(step.header.step_id, None) is not None
        self.watch.done(step, failed)

    @property
    def pace(self) -> StepPace:
        """The ring's measured pace (what the scheduler sizes prompt chunks by)."""
        return self.watch.pace

    def overdue(self) -> ClusterFailure | None:
        """For a watchdog thread: RingWatch.overdue."""
        return self.watch.overdue()

    def lagging(self, factor: float = 4.0, floor: float = 1.0) -> LinkFailure | None:
        """For a status page: RingWatch.lagging."""
        return self.watch.lagging(factor, floor)

    def ring_failure(self, e: Exception) -> ClusterFailure | None:
        """`e`, raised while rank 0 posted a step (its input was a receive from the
        ring), as the cluster failure it is when the ring broke; None otherwise."""
        if self.ring is None or not isinstance(e, RuntimeError) or "[ring]" not in str(e):
            return None
        broken = self.watch.ring_broken(e, self.ring.prev)
        return broken if isinstance(broken, ClusterFailure) else None

    def worker_stats(self) -> dict[int, Any]:
        return self.hub.snapshot() if self.hub else {}


def hub_ready(hub: ControlHub, world_size: int, timeout: float) -> None:
    missing = hub.wait_for_hello(timeout)
    if missing:
        raise RuntimeError(
            f"ranks {missing} never reached rank 0's side channel within {timeout:.0f} s"
        )
    log.info("all %d workers said hello", world_size - 1)
