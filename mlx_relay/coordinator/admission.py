"""Admission: whether a new sequence's caches fit what the ranks have left now, and the
sequence a request starts as once it takes a slot.

Rank 0's own figures and the workers' from their last heartbeat, less what the running
sequences may still add and plus what parked caches give back when their slot is taken
(memory.admission_shortfall). The scheduler asks before a queued request takes a slot.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlx_relay.coordinator.sampling import Sampler
from mlx_relay.coordinator.sequence import Request, Sequence
from mlx_relay.coordinator.slots import Taken
from mlx_relay.coordinator.speculation import SpecState
from mlx_relay.model import memory, vision

if TYPE_CHECKING:
    from mlx_relay.coordinator.model_context import ModelContext
    from mlx_relay.transport.hub import ControlHub

RECHECK_S = 0.05  # a request that waits is rechecked at most this often


class MemoryCheck:
    """The check for one loaded model (its files, each rank's layers, its context)."""

    def __init__(
        self, loaded: Any, context_length: int, max_context: int, hub: ControlHub | None
    ) -> None:
        """`loaded`: the pipeline's LoadedModel (its path, layer ranges, fingerprint);
        `hub`: the workers' heartbeats, which carry their memory figures."""
        self.path = Path(loaded.path)
        self.ranges: list[tuple[int, int]] = loaded.ranges
        self.fingerprint: str = loaded.fingerprint
        self.bound = memory.sequence_bound(context_length, max_context) or 1 << 30
        self.hub = hub
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

    def bytes_per_token(self) -> float:
        """The most cache bytes a token takes on any rank (memory.bytes_per_token;
        CacheUnknown where a rank's caches are not known)."""
        return memory.bytes_per_token(self.path, self.ranges)

    def figures(self) -> dict[int, dict[str, Any]]:
        """Each rank's latest memory figures: rank 0's now, the workers' last heartbeat's."""
        figures = {0: memory.stats()}
        if self.hub is not None:
            figures.update({r: i.stats for r, i in self.hub.snapshot().items()})
        return figures


def new_sequence(
    request: Request, taken: Taken, model: ModelContext, spec: SpecState | None
) -> Sequence:
    """The sequence `request` starts as in the slot it took: from the parked cache's
    tokens it may reuse, its own sampler and text stream (the output rules')."""
    cached = cached_before_images(request, taken.cached, model.config)
    return Sequence(
        request=request,
        slot=taken.slot,
        sampler=Sampler(request.params),
        text=model.output.stream(request, model.markup),
        pending=list(request.prompt_tokens[cached:]),
        position=cached,
        context=list(request.prompt_tokens[:cached]),
        cached_tokens=cached,
        taken=taken,
        spec=spec,
    )


def cached_before_images(request: Request, cached: int, config: dict[str, Any]) -> int:
    """What of a cached prefix an image request reuses: all of it (the cache matched its
    image-keyed tokens, image_keys.py, so past its first image it holds the same images),
    except where the prompt goes whole from position 0 (vision.prefills_whole: gemma4's
    image mask)."""
    if request.pixel_values is None or not cached:
        return cached
    return 0 if vision.prefills_whole(config) else cached
