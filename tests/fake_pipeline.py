"""A test double of rank 0's pipeline: the whole model in this process, faults on demand.

`FakePipeline` is the real one-rank `Pipeline` (every layer on rank 0, no ring), so its
tokens are single-process mlx-lm's, with what a cluster adds around it made
controllable for the engine's tests (tests/test_engine.py): several steps in flight
(`depth`, which a ring of that many ranks allows), a gate that holds every completion
(a slow ring), and one-shot faults: a rank failing a step, the ring breaking, rank 0's
own stage failing at launch. Nothing of the engine is replaced.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from mlx_relay.coordinator.config import EngineConfig
from mlx_relay.coordinator.engine import Engine
from mlx_relay.coordinator.pipeline import ClusterFailure, Pipeline, RankFailure, Step
from mlx_relay.protocol import header as hdr

Match = Callable[[Step], bool]


def forward(step: Step) -> bool:
    return step.header.cmd == hdr.CMD_FORWARD


class FakePipeline(Pipeline):
    def __init__(self, depth: int = 2) -> None:
        super().__init__(None, None)
        self.depth = depth  # steps in flight at once, as a ring of `depth` ranks allows
        self.gate = threading.Event()  # completions wait for it (cleared: a stalled ring)
        self.gate.set()
        self.launched: list[hdr.StepHeader] = []  # every forward step's header, in order
        self.frees: list[tuple[list[int], bool]] = []  # (slots, park) of every free
        self.at_load: list[hdr.StepHeader] = []  # the forward steps the load ran (engines)
        self.frees_at_load: list[tuple[list[int], bool]] = []
        self._complete_faults: list[tuple[Match, RankFailure]] = []
        self._launch_faults: list[tuple[bool, Exception]] = []
        self._pending: list[tuple[Match, RankFailure]] = []

    # --- faults ----------------------------------------------------------------------
    def fail_step(self, rank: int, message: str, match: Match = forward) -> None:
        """The next step `match` accepts comes back failed by `rank` (the ring in step)."""
        self._complete_faults.append((match, RankFailure(rank, "", message)))

    def break_ring(self, rank: int, message: str, match: Match = forward) -> None:
        """At the next step `match` accepts, `rank` is gone: nothing is in step any more."""
        self._complete_faults.append((match, ClusterFailure(rank, "", message)))

    def fail_launch(self, message: str, decode: bool = False) -> None:
        """Rank 0's own stage raises while it builds the next prefill step (or with
        `decode`, the next decode group's step)."""
        self._launch_faults.append((decode, RuntimeError(message)))

    # --- the pipeline's interface --------------------------------------------------
    def launch_forward(self, slots, offsets, tokens, lengths, **kw) -> Step:
        decode = kw.get("group", hdr.NO_GROUP) != hdr.NO_GROUP
        for i, (when, fault) in enumerate(self._launch_faults):
            if when == decode:
                del self._launch_faults[i]
                raise fault
        step = super().launch_forward(slots, offsets, tokens, lengths, **kw)
        self.launched.append(step.header)
        fault = _take(self._complete_faults, step)
        if fault is not None:
            self._pending.append((lambda s, launched=step: s is launched, fault))
        return step

    def launch_free(self, slots: list[int], park: bool = False) -> Step | None:
        self.frees.append((list(slots), park))
        return super().launch_free(slots, park)

    def complete(self, step: Step, *, early: bool = False):
        self.gate.wait()
        fault = _take(self._pending, step)
        if fault is not None:
            raise fault
        return super().complete(step, early=early)


def _take(faults: list[tuple[Match, RankFailure]], step: Step) -> RankFailure | None:
    for i, (match, fault) in enumerate(faults):
        if match(step):
            del faults[i]
            return fault
    return None


@contextmanager
def engines(model: Path | str) -> Iterator[Callable[..., tuple[Engine, FakePipeline]]]:
    """start(depth=2, **engine_args) -> (an Engine serving `model` on a FakePipeline of
    `depth` steps in flight, that pipeline); every engine started is stopped at the end."""
    running: list[Engine] = []

    def start(depth: int = 2, **kwargs) -> tuple[Engine, FakePipeline]:
        pipeline = FakePipeline(depth)
        engine = Engine(pipeline, EngineConfig(**kwargs))
        engine.start()
        running.append(engine)
        engine.load(str(model)).result(120)
        # (what the load itself ran, a warm-up's or drafting's timed steps, kept apart)
        pipeline.at_load, pipeline.launched = pipeline.launched, []
        pipeline.frees_at_load, pipeline.frees = pipeline.frees, []
        return engine, pipeline

    try:
        yield start
    finally:
        for engine in running:
            engine.pipeline.gate.set()
            if engine.running:
                engine.free(shutdown=True).result(60)
            engine.join(10)
