"""How a hop is timed (`--hop-mode`): one small class a mode, behind one interface.

A `Ring` (ring.py) moves bytes; its `Hops` says *when*: whether a step is announced as
soon as it is decided or once its payload is computed, whether a payload may travel in
the header's message, which hops of a step are all-sums of a pair, whether a receive is
waited for before what reads it launches, and whether rank 0 may build on a step's
return before it came. Rank 0's ring driver (coordinator/ring_driver.py) and the
workers ask these questions of the ring, never which mode runs.

EAGER: a step is announced when it is decided, and every receive is posted at once, so
each rank builds and queues its part of the step while the ranks before it still
compute; a busy rank keeps one core spinning on its posted receive (MLX's ring backend
polls its socket). READY: a step is announced once its payload is computed and a
receive is posted only when its data is there: nothing spins, but every hop adds a
wake-up and the next rank's graph building to the token. COLLECTIVE (two ranks): timed
as EAGER, and each payload is an all-sum of the pair (collective.py), on CUDA over NCCL
on the GPU's streams: nothing is settled, and a rank's kernels wait for their input on
the device. ADAPTIVE (two ranks): timed as EAGER; a step launched while no other is in
flight (single-stream decode) hops collectively both ways, one launched beside others
(load, a long prompt's chunks) collectively out of rank 0 and back inline: the last
rank sends its output in the header's message once computed, from its outbox's thread
(outbox.py says why not over the ring; a return larger than INLINE_BACK_MAX_BYTES still
takes it). Two collective steps in flight did not overlap on CUDA, and with collective
returns under load a run stalled (bench/RESULTS.md, sessions 12 and 13). The header
says which hops are all-sums (FLAGS_COLLECTIVE) and which return inline
(FLAG_INLINE_BACK), so every rank does alike, and each transport keeps its own order.

Where new transports plug in: a JACCL RDMA transport that times hops its own way is a
`Hops` subclass here (named in HOP_MODES and `hops_for`), with its byte moving beside
Ring's `_post_send`/`_post_recv` (ring.py fences JACCL's shape changes already). A
tensor-parallel group inside a stage (mlx-lm's `model.shard` over an mx.distributed
sub-group) is not a hop: its all-reduces run inside a rank's layers
(model/stage.py), and only the group's leader takes part in the ring's hops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import mlx.core as mx

from mlx_relay import timeline
from mlx_relay.protocol import header as hdr

EAGER = "eager"
READY = "ready"
COLLECTIVE = "collective"
ADAPTIVE = "adaptive"
HOP_MODES = (EAGER, READY, COLLECTIVE, ADAPTIVE)
PAIRED_MODES = (COLLECTIVE, ADAPTIVE)  # the modes whose payloads may be all-sums of a pair
# ADAPTIVE returns up to this size inline (a batch of 32 rows of hidden 4,096 in 16 bits):
# with a step or two in flight, what rank 0 has not read yet fits the socket's buffer.
INLINE_BACK_MAX_BYTES = 1 << 18

Settle = Callable[..., None]  # Ring.settle: wait for these receives (where it settles)


class Hops:
    """One hop mode's timing (READY's by default: see the subclasses)."""

    name: ClassVar[str]
    # announced when launched (and a return's receive posted then), not once computed
    eager: ClassVar[bool] = False
    paired: ClassVar[bool] = False  # payloads may be all-sums of a pair (PayloadGroups)
    # a small computed payload may travel in its header's message (ring.INLINE_MAX_BYTES)
    carries_inline: ClassVar[bool] = False

    def settles(self, device_settles: bool) -> bool:
        """Whether receives are waited for before what reads them launches, given
        whether this device needs it (ring.settles_here: CUDA)."""
        return device_settles

    def choose_path(
        self, header: hdr.StepHeader, *, alone: bool, returned_bytes: Callable[[], int]
    ) -> None:
        """Rank 0, launching a step (`alone`: nothing else in flight; `returned_bytes`:
        the size of what the last rank sends back, asked only where it matters): mark in its header which of its hops are
        all-sums and whether the return comes inline. A second lap's header is its
        first's copy: its flags are cleared first."""
        header.flags &= ~(hdr.FLAGS_COLLECTIVE | hdr.FLAG_INLINE_BACK)

    def before_header(
        self,
        header: hdr.StepHeader,
        payload: mx.array | None,
        sides: list[mx.array],
        reads: list[mx.array | None],
        settle: Settle,
    ) -> None:
        """What a rank does before it announces a step it sends on (READY: wait until
        the payload is computed, its received inputs settled first)."""
        if payload is not None:
            settle(*reads)
            mx.eval(payload, *sides)
            timeline.mark("computed", header.step_id)

    def after_header(
        self,
        header: hdr.StepHeader,
        reads: list[mx.array | None],
        settle: Settle,
        *,
        received_collectively: bool,
    ) -> None:
        """What a rank does between announcing a step and posting its payload's send."""

    def returns_early(self, header: hdr.StepHeader) -> bool:
        """Whether rank 0 may build on the return of a step that wants logits before it
        came, in a mailbox the host writes it into (coordinator/returns.py): a return
        that comes inline, or (READY) any on the CPU device, whose payload comes
        computed, into memory the host can write."""
        return bool(header.flags & hdr.FLAG_INLINE_BACK) or mx.default_device() == mx.cpu

    def posts_return_at_launch(self, header: hdr.StepHeader) -> bool:
        """Whether rank 0 posts the receive of a step's return when it launches the step
        (else when it completes it, once the header came back)."""
        return self.eager and not header.flags & hdr.FLAG_INLINE_BACK


class ReadyHops(Hops):
    name = READY
    carries_inline = True


class EagerHops(Hops):
    name = EAGER
    eager = True

    def before_header(self, header, payload, sides, reads, settle) -> None:
        pass  # (announced at once: the next rank queues its part meanwhile)

    def after_header(self, header, reads, settle, *, received_collectively) -> None:
        if not received_collectively:  # (an all-sum's input is waited for on the device)
            settle(*reads)
            timeline.mark("settled", header.step_id)

    def returns_early(self, header: hdr.StepHeader) -> bool:
        return bool(header.flags & hdr.FLAG_INLINE_BACK)


class CollectiveHops(EagerHops):
    name = COLLECTIVE
    paired = True

    def settles(self, device_settles: bool) -> bool:
        return False  # (NCCL waits on the device)

    def choose_path(
        self, header: hdr.StepHeader, *, alone: bool, returned_bytes: Callable[[], int]
    ) -> None:
        super().choose_path(header, alone=alone, returned_bytes=returned_bytes)
        header.flags |= hdr.FLAGS_COLLECTIVE
        timeline.mark("collective", header.step_id)


class AdaptiveHops(EagerHops):
    name = ADAPTIVE
    paired = True

    def choose_path(
        self, header: hdr.StepHeader, *, alone: bool, returned_bytes: Callable[[], int]
    ) -> None:
        super().choose_path(header, alone=alone, returned_bytes=returned_bytes)
        if alone:
            header.flags |= hdr.FLAGS_COLLECTIVE
            timeline.mark("collective", header.step_id)
            return
        header.flags |= hdr.FLAG_COLLECTIVE_OUT
        if returned_bytes() <= INLINE_BACK_MAX_BYTES and not header.sides:
            header.flags |= hdr.FLAG_INLINE_BACK
            timeline.mark("inline_back", header.step_id)


_HOPS: dict[str, type[Hops]] = {
    h.name: h for h in (EagerHops, ReadyHops, CollectiveHops, AdaptiveHops)
}


def hops_for(mode: str) -> Hops:
    """The timing of `mode` (one of HOP_MODES)."""
    if mode not in _HOPS:
        raise ValueError(f"hop mode {mode!r}: expected one of {', '.join(HOP_MODES)}")
    return _HOPS[mode]()
