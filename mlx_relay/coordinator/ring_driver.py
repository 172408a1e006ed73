"""Rank 0's end of the ring: send steps round in order and take them back in order.

Every step is one that every rank takes in the same order, started by a header rank 0
wrote. Steps are *launched* and later *completed* in FIFO order, so several can be in
flight around the ring at once: while rank 1 works on one decode group, rank 0 already
runs its layers for the next. Commands (load, unload, shutdown, probe) wait until
nothing is in flight. A free of slots waits for a two-pass model's first lap to finish
its second (`launch_free`). The ring watch (ring_watch.py) times every step and names
the rank at fault. With one rank there is no ring and the same calls run locally.

When a step goes on and when its return is received is the hops' business
(transport/hops.py): the driver asks the ring, never which mode runs. What rank 0
computes (its layers, a second lap, the LM head) is its runner's (runner.py).

Where new transports plug in: a transport other than MLX's ring backend (JACCL RDMA)
is a `Ring` with its own `Hops`; nothing here changes. A tensor-parallel step
(`launch_tensor`) is computed here whole, as with one rank: only its header goes round,
to start the peers, and comes back as their acknowledgement. In a stage x tensor grid
rank 0 computes stage 0's part with its peers, and the step comes back from the last
stage as a pipeline's does.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlx_relay import timeline
from mlx_relay.coordinator.returns import Completion, Returns
from mlx_relay.coordinator.ring_watch import ClusterFailure, RankFailure, RingWatch
from mlx_relay.coordinator.runner import StageRunner
from mlx_relay.protocol import header as hdr
from mlx_relay.transport.doorbell import DoorbellTimeout, NeighbourGone
from mlx_relay.transport.hub import ControlHub
from mlx_relay.transport.ring import Ring, bytes_payload, dtype_name
from mlx_relay.transport.tensor import TensorGroup

log = logging.getLogger("mlx_relay.pipeline")

WATCH_INTERVAL_S = 0.1


@dataclass
class Step:
    """A step launched round the ring, completed later in launch order.

    Launching posts rank 0's part; announcing sends it on (header on the doorbell,
    payload on the ring): at once or once computed, as the hops say. Completing takes
    the header back and the payload's receive (posted at launch or now), giving the
    logits as a graph still to be computed: the caller posts what depends on them (the
    next step) before it reads them, so the device never idles while the host waits.
    """

    header: hdr.StepHeader
    want_logits: bool
    hidden: mx.array | None = None
    posted: Any = None  # the payload's (and side arrays') sends in flight, kept alive
    returned: mx.array | None = None  # the return's receive, where posted at launch
    launched_at: float = field(default_factory=time.monotonic)
    tag: Any = None  # the engine's own bookkeeping
    units: float = 0.0  # a forward step's work (pace.step_cost)
    took: float = 0.0  # seconds from when it could start to done with (see pace.py)
    sides: list[mx.array] = field(default_factory=list)  # sent after the payload
    lap: int = 1  # which time round the ring (a two-pass model's steps go twice)


class RingDriver:
    def __init__(
        self,
        ring: Ring | None,
        hub: ControlHub | None,
        runner: StageRunner,
        *,
        heartbeat_timeout: float,
        step_timeout: float,
        steps_in_flight: int,
    ) -> None:
        self.ring = ring
        self.runner = runner
        self.world_size = ring.size if ring else 1
        # Which steps are out, their deadlines, and whom to name when one is late.
        self.watch = RingWatch(
            hub,
            self.world_size,
            heartbeat_timeout=heartbeat_timeout,
            step_timeout=step_timeout,
            eager=ring is not None and ring.announces_at_launch(),
        )
        # Steps round the ring at once (0: one a rank). More than one a rank keeps a
        # rank's device busy while its host waits for a return and launches what reads it.
        self.depth = steps_in_flight if steps_in_flight and self.world_size > 1 else self.world_size
        self._in_flight: deque[Step] = deque()
        self._step_id = 0
        self._unannounced: deque[tuple[Step, mx.array | None]] = deque()
        # Frees asked for while a two-pass model's first lap is round the ring: they go
        # after its second lap, here and on the ring (see launch_free).
        self._deferred: deque[tuple[Step | None, list[int], bool]] = deque()
        self.returns = Returns(ring, self.depth + 1, self._receive)

    @property
    def next_id(self) -> int:
        """The id the next step launched gets (for timeline marks before it has one)."""
        return self._step_id + 1

    @property
    def in_flight_limit(self) -> int:
        """How many steps may be round the ring at once: `depth`, or one for a model
        whose steps go round twice (the second lap starts from the first's return)."""
        return 1 if self.runner.laps == 2 else self.depth

    # --- launching -------------------------------------------------------------------
    def post_here(self, step: Step, hidden: mx.array, tokens: mx.array) -> None:
        """One rank: the step's output is rank 0's own (`hidden`), posted, numbered as
        on a ring (for the timeline and logs)."""
        step.hidden = hidden
        mx.async_eval(tokens)  # (first, apart: see launch)
        mx.async_eval(step.hidden)
        self._step_id += 1
        step.header.step_id = self._step_id
        timeline.mark("posted", step.header.step_id)

    def launch_tensor(self, step: Step, hidden: mx.array, tokens: mx.array) -> None:
        """A tensor-parallel step (FLAG_TENSOR): rank 0 computed its part (`hidden`); its
        header goes round the ring at once, after every step launched before it (a free
        must reach the peers before a step that reuses its slot), so each peer posts its
        part of the step while rank 0 posts its own. With one stage the output is here
        whole; in a stage x tensor grid `hidden` is only stage 0's part, posted to run
        its all-sums with its peers, and the step comes back from the last stage as a
        pipeline's does."""
        assert self.ring is not None
        self.settle()
        mx.async_eval(tokens)  # (first, apart: see launch)
        self.announce()
        self._in_flight.append(step)
        self._send_header_alone(step)
        mx.async_eval(hidden)
        if self._whole_here(step):
            step.hidden = hidden
        else:
            step.posted = hidden  # (alive until it ran)
            if self.ring.posts_return_at_launch(step.header):
                back = hdr.returned(step.header, self.runner.returned_width(step.header))
                step.returned = self.ring.post_recv_payload(back)
        timeline.mark("posted", step.header.step_id)

    def launch(self, step: Step, payload: mx.array | None, tokens: mx.array | None = None) -> None:
        """Post rank 0's part of the step and, where the hops announce at launch, send
        it on and post the receive of what comes back; otherwise `announce` sends it
        once it is computed.

        The step's input `tokens` (sampled from the last return, not read yet) are
        posted first, on their own: MLX gives every array of one evaluation one event,
        signalled once all of it has run, so posted with rank 0's layers they could be
        read only after those, and the engine thread, reading them, took the next
        return that much later (7 ms of a 21 ms period under load on two H100s)."""
        assert self.ring is not None
        self.settle()
        if tokens is not None:
            mx.async_eval(tokens)
        if self._deferred and step.lap == 1:
            if not self._first_lap_in_flight():  # (frees that waited for a first lap
                self._release_deferred()  # that failed go before anything later)
        self._step_id += 1
        step.header.step_id = self._step_id
        if tokens is not None:
            timeline.mark_when_computed("sampled", step.header.step_id, tokens)
        self.watch.launched(step)
        width = self.runner.returned_width(step.header)
        # (a prompt's chunk before its last wants no logits and its next chunk follows at
        # once: it is never alone, so its return stays off the GPU streams. With an
        # all-sum back on two H100s, rank 0's next chunk waited for the first one's whole
        # trip round the ring: 4 ranks began flowing only after ~80 ms.)
        alone = not self._in_flight and step.want_logits
        self.ring.choose_path(step.header, alone=alone, returned_width=width)
        self._in_flight.append(step)
        if not self.ring.announces_at_launch():
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
            if self.ring.posts_return_at_launch(step.header):
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

    # --- frees -------------------------------------------------------------------------
    def launch_free(self, slots: list[int], park: bool = False) -> Step | None:
        """Drop the slots' caches (or, with `park`, keep each as a single sequence's for
        a later prefix reuse) here now and on every worker when the step reaches it.

        While a two-pass model's first lap is round the ring, its second lap (launched
        when the first comes back) still needs the caches of its slots, here and on the
        ring: the free waits for it, and goes right after it (`_release_deferred`)."""
        step = None
        if self.world_size > 1 and slots and self.runner.shard is not None:
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

    def launch_blocks(self, cmd: int, slot: int, document: dict[str, Any]) -> Step | None:
        """CMD_STORE / CMD_RESTORE of `slot` (model/prefix_store.py): rank 0's part now
        (StoreError or CacheError where its restore cannot: then nothing is sent), each
        worker's when the step reaches it. None with no worker."""
        self.runner.blocks(cmd, slot, document)
        if self.world_size == 1 or self.runner.shard is None:
            return None
        header = hdr.StepHeader(cmd=cmd, slots=[slot])
        header.offsets = header.lengths = [0]
        payload = bytes_payload(json.dumps(document).encode())
        header.payload_kind = hdr.PAYLOAD_BYTES
        header.payload_dtype = "uint8"
        header.payload_shape = (payload.size, 0, 0)
        step = Step(header, want_logits=False)
        self._release_deferred()
        self.launch(step, payload)
        return step

    def _first_lap_in_flight(self) -> bool:
        return any(self.runner.more_laps(s.header) for s in self._in_flight)

    def _free(self, step: Step | None, slots: list[int], park: bool) -> None:
        self.runner.free(slots, park)
        if step is not None:
            self.launch(step, None)

    def _release_deferred(self) -> None:
        """The frees that waited for a second lap (launch_free), in order."""
        waiting = list(self._deferred)
        self._deferred.clear()
        for step, slots, park in waiting:
            self._free(step, slots, park)

    # --- completing --------------------------------------------------------------------
    def complete(self, step: Step, *, early: bool = False) -> Completion:
        """Take the oldest step in flight back: its logits (batch, vocab) if it asked for
        them, as a graph still to be computed, and what must happen before they are
        read (Completion). RankFailure if a rank failed it.

        `early`: where the hops allow it (Ring.returns_early), the logits come before the
        step has come back, built on a mailbox (returns.py) that the completion's
        `settle` fills, so the caller builds the next step (sampling, embedding, rank 0's
        layers) while the other ranks compute. A rank's failure of the step then raises
        from that settle."""
        logits = self._complete(step, early)
        return Completion(logits, lambda: self.returns.pending, lambda: self._settle_for(step))

    def _settle_for(self, step: Step) -> None:
        self.settle()
        failure = self.returns.failure_of(step)
        if failure is not None:
            raise failure

    def _complete(self, step: Step, early: bool) -> mx.array | None:
        if self.world_size > 1:
            if any(deferred is step for deferred, _, _ in self._deferred):
                self._release_deferred()  # (its first lap failed: no second lap came)
            if not self._in_flight or self._in_flight[0] is not step:
                raise RuntimeError("steps must complete in the order they were launched")
            self._in_flight.popleft()
            self.announce()
            step.posted = None
            if self._whole_here(step):  # (its output is here: see launch_tensor)
                self._receive(step)  # (the peers' acknowledgement)
                return self._logits_here(step)
            if early and self._returns_early(step):
                step.hidden = self.returns.mailbox(step, self.runner.returned_width(step.header))
                return self.runner.logits(step.header, step.hidden)
            self.returns.fill_mailboxes(self.watch.is_out)  # (returns come back in order)
            _, step.hidden = self._receive(step)
            if self.runner.more_laps(step.header):
                return self._next_lap(step)
        return self._logits_here(step)

    def _whole_here(self, step: Step) -> bool:
        """Whether rank 0 computed the step's output itself (a tensor step of one stage:
        its header comes back alone, the peers' acknowledgement)."""
        split = self.runner.tensor
        return bool(step.header.flags & hdr.FLAG_TENSOR) and (split is None or not split.grid)

    def _logits_here(self, step: Step) -> mx.array | None:
        """The logits of a step whose output is here (`step.hidden`), as a graph; a step
        that wants none is waited for (it is timed)."""
        if not step.want_logits:
            self.settle()
            mx.eval(step.hidden)  # computed on every rank when this returns
            return None
        return self.runner.logits(step.header, step.hidden)

    def _returns_early(self, step: Step) -> bool:
        """Whether `step`'s return can be built on before it came: one that wants logits,
        goes round once, and whose hops allow it."""
        return (
            step.want_logits
            and not self.runner.more_laps(step.header)
            and self.ring.returns_early(step.header)
        )

    def _next_lap(self, step: Step) -> mx.array | None:
        """A step whose first lap came back that goes round again (a two-pass model's):
        rank 0's part of the next lap, sent round; what that lap returns is the step's.
        Only one step is in flight for such a model (in_flight_limit), so the next lap
        follows its first directly."""
        assert step.hidden is not None
        header, h = self.runner.next_lap(step.header, step.hidden)
        lap = Step(header, step.want_logits, lap=step.lap + 1)
        self.launch(lap, h)
        self._release_deferred()
        try:
            return self._complete(lap, early=False)
        finally:
            self.done(lap)

    def complete_all(self) -> None:
        """Let every step in flight come back (before a command, or when giving up)."""
        while self._in_flight or self._deferred:
            if not self._in_flight:
                self._release_deferred()
                continue
            step = self._in_flight[0]
            try:
                self._complete(step, early=False)
            except RankFailure as e:
                if isinstance(e, ClusterFailure):
                    raise
                log.warning("dropped %s: %s", step.header.describe(), e)
            finally:
                self.done(step)

    def settle(self) -> None:
        """Make usable the returns received since the last launch (see returns.py): the
        last thing before launching what reads them, so rank 0 builds its next step
        (head, sampling, embedding, its layers) while the return is still on its way,
        instead of after it arrived."""
        if not self.returns.pending:
            return
        timeline.mark("settle", self._step_id + 1)
        self.returns.settle(self.watch.is_out)
        timeline.mark("return_settled", self._step_id + 1)

    def done(self, step: Step) -> None:
        """The caller has what it wanted of `step` (its results were read): the ring's
        pace learns what a forward step that came back whole took."""
        failed = self.returns.failure_of(step) is not None
        self.watch.done(step, failed)

    # --- commands ----------------------------------------------------------------------
    def command(
        self, cmd: int, payload: mx.array | None = None, slots: list[int] | None = None
    ) -> hdr.StepHeader:
        """One command round the ring, once nothing else is: the header that came back."""
        self.complete_all()
        header = hdr.StepHeader(cmd=cmd, slots=list(slots or []))
        header.offsets = [0] * header.n_seqs
        header.lengths = [0] * header.n_seqs
        if payload is not None:
            header.payload_kind = hdr.PAYLOAD_BYTES
            header.payload_dtype = "uint8"
            header.payload_shape = (payload.size, 0, 0)
        step = Step(header, want_logits=False)
        self.launch(step, payload)
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

    def time_all_sum(self, tensor: TensorGroup, shape: tuple[int, ...], dtype: mx.Dtype) -> float:
        """Seconds one all-sum of `shape` takes over the tensor group, timed by every rank
        of it at once (CMD_TIME_ALL_SUM goes round first, as a tensor step's header
        does), once nothing else is in flight."""
        assert self.ring is not None
        self.complete_all()
        header = hdr.StepHeader(cmd=hdr.CMD_TIME_ALL_SUM, flags=hdr.FLAG_TENSOR)
        header.payload_dtype = dtype_name(dtype)
        header.payload_shape = shape
        step = Step(header, want_logits=False)
        self._send_header_alone(step)
        try:
            seconds = tensor.time_all_sum(shape, dtype)
            self._receive(step)  # (the peers' acknowledgement)
        finally:
            self.done(step)
        return seconds

    def time_pair_sums(
        self, pairs: TensorGroup, shape: tuple[int, ...], dtype: mx.Dtype
    ) -> list[float]:
        """Seconds one all-sum of `shape` takes over each pair of a grid of pairs (rank 0's
        first), each pair timed over its own link as the header reaches it, one pair
        after another: a pair's second rank writes its figure into the header before
        sending it on (FLAG_PAIRS), so the header that comes back holds them all."""
        assert self.ring is not None
        self.complete_all()
        ranks = list(range(self.world_size))
        header = hdr.StepHeader(
            cmd=hdr.CMD_TIME_ALL_SUM, flags=hdr.FLAG_TENSOR | hdr.FLAG_PAIRS, slots=ranks
        )
        header.offsets, header.lengths = [0] * len(ranks), [0] * len(ranks)
        header.payload_dtype = dtype_name(dtype)
        header.payload_shape = shape
        step = Step(header, want_logits=False)
        self._send_header_alone(step)
        try:
            pairs.time_all_sum(shape, dtype)  # (rank 0's pair: rank 1 writes its figure)
            back, _ = self._receive(step)
        finally:
            self.done(step)
        return [back.lengths[r] / 1e6 for r in range(1, self.world_size, 2)]

    def _send_header_alone(self, step: Step) -> None:
        """Number `step`, start its deadline and send its header round the ring with no
        payload behind it: a tensor step's peers compute their parts from their own
        copies of its input, and a timing command carries nothing."""
        assert self.ring is not None
        self._step_id += 1
        step.header.step_id = self._step_id
        self.watch.launched(step)
        try:
            self.ring.send_header(step.header)
        except RuntimeError as e:
            raise self.watch.ring_broken(e, self.ring.next) from e

    # --- the ring ----------------------------------------------------------------------
    def _receive(self, step: Step, host_bytes: bool = False) -> tuple[hdr.StepHeader, Any]:
        """The header that came back, and the receive of its payload, posted (with
        `host_bytes`, an inline payload as its bytes, a NumPy uint8 array). A failed
        step's payload (zeros) is received all the same, so the ring stays in step."""
        header = step.header
        back = self._wait_for_return(step)
        timeline.mark("returned", back.step_id)
        shape = hdr.payload_nbytes_shape(back)
        expected = hdr.returned(header, self.runner.returned_width(header))
        if (
            back.step_id != header.step_id
            or back.cmd != header.cmd
            or (back.flags ^ header.flags) & hdr.FLAGS_COLLECTIVE
            or shape != hdr.payload_nbytes_shape(expected)
        ):
            raise ClusterFailure(
                -1, "", f"ranks out of step: sent {header.describe()}, got {back.describe()}"
            )
        out, step.returned = step.returned, None
        if host_bytes and back.flags & hdr.FLAG_INLINE:
            out = self.ring.take_inline_bytes(back)
        elif not self.ring.posts_return_at_launch(header):
            try:
                out = self.ring.post_recv_payload(back)
            except RuntimeError as e:
                raise self.watch.ring_broken(e, self.ring.prev) from e
        if back.error_mask:
            raise self.watch.failure(back)
        if isinstance(out, mx.array) and self.ring.settles_return(header, back):
            self.returns.hold(out)  # (settled right before what reads it launches)
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

    def ring_failure(self, e: Exception) -> ClusterFailure | None:
        """`e`, raised while rank 0 posted a step (its input was a receive from the
        ring), as the cluster failure it is when the ring broke; None otherwise."""
        if self.ring is None or not isinstance(e, RuntimeError) or "[ring]" not in str(e):
            return None
        broken = self.watch.ring_broken(e, self.ring.prev)
        return broken if isinstance(broken, ClusterFailure) else None
