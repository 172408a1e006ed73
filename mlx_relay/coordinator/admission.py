"""The memory check at admission: whether a new sequence's caches fit what the ranks have
left now.

Rank 0's own figures and the workers' from their last heartbeat, less what the running
sequences may still add and plus what parked caches give back when their slot is taken
(memory.admission_shortfall). The scheduler asks before a queued request takes a slot.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlx_relay.coordinator.sequence import Request, Sequence
from mlx_relay.model import memory

RECHECK_S = 0.05  # a request that waits is rechecked at most this often


class MemoryCheck:
    """The check for one loaded model (its files, each rank's layers, its context)."""

    def __init__(
        self,
        path: str,
        ranges: list[tuple[int, int]],
        fingerprint: str,
        context_length: int,
        figures: Callable[[], dict[int, dict[str, Any]]],
    ) -> None:
        self.path = Path(path)
        self.ranges = ranges
        self.fingerprint = fingerprint
        self.bound = memory.sequence_bound(context_length) or 1 << 30
        self.figures = figures  # each rank's latest memory.stats()
        self._last: tuple[float, Request | None, str] = (0.0, None, "")

    def most(self, request: Request) -> int:
        """The tokens a sequence of `request` may reach."""
        return min(len(request.prompt_tokens) + request.params.max_tokens, self.bound)

    def shortfall(self, request: Request, running: list[Sequence], parked: list[int]) -> str:
        """Why `request`'s caches would not fit now ('' if they would), beside the
        `running` sequences and the `parked` caches' token counts."""
        now = time.monotonic()
        at, last, short = self._last
        if last is request and now - at < RECHECK_S:
            return short
        short = memory.admission_shortfall(
            self.path,
            self.ranges,
            self.figures(),
            self.most(request),
            [(s.position, self.most(s.request)) for s in running],
            parked,
            self.fingerprint,
        )
        self._last = (now, request, short)
        return short
