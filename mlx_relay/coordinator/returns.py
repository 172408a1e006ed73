"""What rank 0 holds of a step's return before what reads it may launch.

Rank 0 builds a step's head, sampling and next step before the return those read is
usable, and waits for it only right before launching them (`settle`), so its device
never idles while its host waits. Two kinds of return need that wait, as the ring's
hops say (transport/hops.py): a receive to be *settled* (on CUDA, the kernels reading
it launch only once it finished: ring.py says why), and a return handed out *early*,
a mailbox (mailboxes.py) that the host writes the return's bytes into once it came
(READY hops on the CPU, inline returns). The engine sees neither: completing a step
gives it a `Completion`, whose `settle` does what must happen first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from mlx_relay.coordinator.mailboxes import Mailboxes
from mlx_relay.coordinator.ring_watch import ClusterFailure, RankFailure
from mlx_relay.protocol import header as hdr
from mlx_relay.transport.ring import Ring, mx_dtype, payload_nbytes

if TYPE_CHECKING:
    from mlx_relay.coordinator.ring_driver import Step

log = logging.getLogger("mlx_relay.pipeline")

# (step, host_bytes) -> the header that came back and its payload (ring_driver's receive)
Receive = Callable[["Step", bool], tuple[hdr.StepHeader, Any]]


@dataclass
class Completion:
    """A step taken back: its logits (a graph still to compute; None where the step
    wanted none), and what must happen before anything reading them is evaluated."""

    logits: mx.array | None
    _pending: Callable[[], bool] = lambda: False
    _settle: Callable[[], None] = lambda: None

    @property
    def ready(self) -> bool:
        """Whether what reads the logits may be evaluated now (else after `settle`)."""
        return not self._pending()

    def settle(self) -> None:
        """Make the return usable: the last thing before launching what reads it, which
        is built meanwhile. A rank's failure of the step raises here (what was built on
        its return is then to be ignored)."""
        self._settle()


class Returns:
    """Receives to settle and mailboxes handed out early, oldest first."""

    def __init__(self, ring: Ring | None, keep: int, receive: Receive) -> None:
        self.ring = ring
        self._receive = receive
        # Returns received but not yet settled (CUDA): what reads them is built
        # meanwhile and launched only after settle.
        self._unsettled: list[mx.array] = []
        # Returns handed out early, not yet read, each with the evaluated array its
        # bytes will be written into; and the failures settle found in them.
        self._early: list[tuple[Step, mx.array]] = []
        self._boxes = Mailboxes(keep=keep)  # (what _early's are taken from)
        self._failures: dict[int, RankFailure] = {}

    @property
    def pending(self) -> bool:
        """Whether a return is still to be settled before what reads it is launched."""
        return bool(self._unsettled or self._early)

    def hold(self, receive: mx.array) -> None:
        """A receive to settle right before what reads it launches."""
        self._unsettled.append(receive)

    def mailbox(self, step: Step, returned_width: int | None) -> mx.array:
        """The return of `step` as it will be, for graphs to be built on: a view of an
        evaluated byte array that `settle` fills (MLX arrays read through their buffer
        what a NumPy view of it wrote)."""
        back = hdr.returned(step.header, returned_width)
        box = self._boxes.take(payload_nbytes(back))
        self._early.append((step, box))
        return box.view(mx_dtype(back.payload_dtype)).reshape(hdr.payload_nbytes_shape(back))

    def settle(self, is_out: Callable[[int], bool]) -> None:
        """Read the returns handed out early, then wait for the receives held."""
        self.fill_mailboxes(is_out)
        if self._unsettled:
            assert self.ring is not None
            self.ring.settle(*self._unsettled)
            self._unsettled.clear()

    def fill_mailboxes(self, is_out: Callable[[int], bool]) -> None:
        """Read the returns handed out early, oldest first, into their mailboxes. A
        rank's failure of one is kept for `failure_of` if its step is still out
        (`is_out`; its mailbox keeps zeros, and what was built on it is ignored); a
        broken cluster raises."""
        while self._early:
            step, box = self._early.pop(0)
            try:
                _, out = self._receive(step, True)
            except RankFailure as e:
                if isinstance(e, ClusterFailure):
                    self._early.clear()
                    raise
                if is_out(step.header.step_id):  # (else nobody reads it)
                    self._failures[step.header.step_id] = e
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
        return self._failures.pop(step.header.step_id, None)

    def clear(self) -> None:
        self._boxes.clear()
