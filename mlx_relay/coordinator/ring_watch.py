"""The ring's health, as rank 0 sees it: which steps are out, how long each should take,
and which rank to name when one is late or the ring breaks.

The ring driver (ring_driver.py) launches and completes steps; it tells a `RingWatch` when each forward step
went out and when it was done with, and asks it whether anything is wrong. The watch
learns the ring's pace from finished steps (pace.py), times each step from when it
could start (launched, and the step before it done with: a chunk queued behind others
is not late for waiting), and names a rank from the side channel (transport/hub.py):
the first one that has not passed the step on, or the one whose heartbeat stopped.
A watchdog thread asks `overdue()` and the live page `lagging()` while the engine
thread may be blocked inside MLX, so both read the steps defensively.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from mlx_relay.coordinator.pace import FIRST_SHAPE_S, SLACK, StepPace, step_shape
from mlx_relay.protocol import header as hdr
from mlx_relay.transport.hub import ControlHub, LinkFailure

if TYPE_CHECKING:
    from mlx_relay.coordinator.ring_driver import Step

RING_BROKEN_WAIT_S = 2.0  # for the side channel to tell which rank broke the ring


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


class RingWatch:
    """Steps out on the ring, their deadlines, and whom to blame."""

    def __init__(
        self,
        hub: ControlHub | None,
        world_size: int,
        *,
        heartbeat_timeout: float,
        step_timeout: float,
        eager: bool,
    ) -> None:
        self.hub = hub
        self.world_size = world_size
        self.heartbeat_timeout = heartbeat_timeout
        # A forward step may take this long, plus SLACK times what it should take at the
        # pace measured (pace.py), from when it could start; 0: forever.
        self.step_timeout = step_timeout
        self.eager = eager  # (eager hops: the overdue message suggests ready ones)
        self.pace = StepPace()
        self._shapes: set[tuple[int, int]] = set()  # step shapes done since the load
        self._free_at = time.monotonic()  # the last step was done with then
        # Launched and not yet done with (header back, and any payload read), oldest first.
        self._outstanding: dict[int, Step] = {}

    def reset(self) -> None:
        """A new model: its pace and the shapes its kernels compiled for are unknown."""
        self.pace = StepPace()
        self._shapes.clear()

    def launched(self, step: Step) -> None:
        self._outstanding[step.header.step_id] = step

    def is_out(self, step_id: int) -> bool:
        return step_id in self._outstanding

    def done(self, step: Step, failed: bool) -> None:
        """The caller has what it wanted of `step`: a forward step that came back whole
        teaches the pace what it took."""
        if self._outstanding.pop(step.header.step_id, None) is None:
            return
        now = time.monotonic()
        step.took = now - self.started(step)
        self._free_at = now
        if step.header.cmd == hdr.CMD_FORWARD and not failed and not step.header.error_mask:
            self.pace.observe(step.units, step.took)
            self._shapes.add(step_shape(step.header.lengths))

    def started(self, step: Step) -> float:
        """When `step` could start: launched, and the step before it done with."""
        return max(step.launched_at, self._free_at)

    def overdue(self, step: Step | None = None) -> ClusterFailure | None:
        """`step`'s failure if it is overdue; without one (a watchdog thread), the oldest
        forward step not done with, if overdue. Once a step's header is back the host
        waits inside MLX (reading its results, or posting work queued behind it), where
        no timeout of ours can reach."""
        step = step or self._oldest_forward()
        return None if step is None else self._overdue(step)

    def _oldest_forward(self) -> Step | None:
        """The oldest forward step not done with, read from another thread (None where
        there is none, or the engine thread changed the steps under us: look next time)."""
        try:
            forward = (s for s in self._outstanding.values() if s.header.cmd == hdr.CMD_FORWARD)
            return next(forward, None)
        except RuntimeError:
            return None

    def lagging(self, factor: float = 4.0, floor: float = 1.0) -> LinkFailure | None:
        """For a status page: the rank holding the oldest forward step if that step is out
        longer than `factor` times what it should take at the measured pace (and `floor`
        seconds), long before the watchdog's allowance: a slow rank, named as `overdue`
        would name it. None while every step keeps pace."""
        step = self._oldest_forward()
        if step is None or self.hub is None:
            return None
        elapsed = time.monotonic() - self.started(step)
        expected = self.pace.expected(step.units)
        if elapsed <= max(floor, factor * expected):
            return None
        suspect = self.hub.suspect(step.header.step_id)
        if suspect is None:
            return None
        return LinkFailure(
            suspect.rank,
            suspect.host,
            f"{step.header.describe()} out for {elapsed:.1f} s (it should take "
            f"{expected:.2f} s at this cluster's pace); {suspect.reason}",
        )

    def _overdue(self, step: Step) -> ClusterFailure | None:
        """`step`'s failure if it took longer than its allowance (pace.py) from when it
        could start, naming the first rank that has not passed it on."""
        header = step.header
        if not (self.step_timeout and header.cmd == hdr.CMD_FORWARD):
            return None
        elapsed = time.monotonic() - self.started(step)
        new_shape = step_shape(header.lengths) not in self._shapes
        allowed = self.pace.allowance(step.units, self.step_timeout, self.world_size, new_shape)
        if elapsed <= allowed:
            return None
        expected = self.pace.expected(step.units)
        suspect = self.hub.suspect(header.step_id) if self.hub else None
        return ClusterFailure(
            suspect.rank if suspect else -1,
            suspect.host if suspect else "",
            f"{header.describe()} overdue: {elapsed:.1f} s since it could start, allowed "
            f"{allowed:.1f} s (--step-timeout {self.step_timeout:g} s"
            + (
                f" + {SLACK:g} x {self.world_size} ranks x the {expected:.2f} s it should "
                "take at this cluster's measured pace)"
                if expected
                else ")"
            )
            + (
                f"; the first step of its shape since the load (at least {FIRST_SHAPE_S:g} s: "
                "its kernels may compile first)"
                if new_shape
                else ""
            )
            + (f"; {suspect.reason}" if suspect else "")
            + (
                "; with eager hops, --hop-mode ready may avoid this (it posts no receive early)"
                if self.eager
                else ""
            ),
        )

    def gone(self) -> ClusterFailure | None:
        """A worker whose heartbeat stopped or whose link closed, named; None if all beat."""
        gone = self.hub.failure(self.heartbeat_timeout) if self.hub else None
        return ClusterFailure(gone.rank, gone.host, gone.reason) if gone else None

    def ring_broken(self, e: RuntimeError, neighbour: int) -> Exception:
        """mx.distributed raised: if a rank is gone, the ring broke with it, so name it.

        A compute error inside `send` (it evaluates the payload first) leaves the ring
        intact and is returned as it is.
        """
        gone = (
            self.hub.wait_failure(self.heartbeat_timeout, RING_BROKEN_WAIT_S) if self.hub else None
        )
        if gone is not None:
            return ClusterFailure(gone.rank, gone.host, gone.reason)
        if "[ring]" in str(e) or "connection" in str(e).lower():
            return ClusterFailure(
                neighbour, self.host(neighbour), f"rank 0's ring connection to it broke: {e}"
            )
        return e

    def failure(self, back: hdr.StepHeader) -> RankFailure:
        """The failure a step's returned header flags, with the rank's own message."""
        rank = back.failed_ranks[0]
        message = self.hub.take_error(back.step_id, rank) if self.hub else None
        reason = hdr.ERROR_NAMES.get(back.error_code, str(back.error_code))
        return RankFailure(rank, self.host(rank), message or reason, back.error_code)

    def host(self, rank: int) -> str:
        """The host a worker reported in its hello, for error messages."""
        info = self.hub.snapshot().get(rank) if self.hub else None
        return info.host if info else ""
