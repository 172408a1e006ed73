"""A model's stages chained in one process, run by the ranks' own code.

Rank 0's part of a step is the coordinator's `StageRunner` (its input, the side arrays a
family takes, its layers, the LM head); each later rank's is the worker loop's own
`WorkerStage.take`, loaded from the same LOAD document rank 0 sends. Only the transport
is left out: every header still goes through the wire format between stages. So an
in-process test of a family's split checks what a cluster runs, in milliseconds.
"""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path
from unittest import mock

import mlx.core as mx

from mlx_relay.coordinator.runner import StageRunner
from mlx_relay.model import memory, sharding
from mlx_relay.model.step_inputs import PromptInputs
from mlx_relay.protocol import header as hdr
from mlx_relay.transport.ring import dtype_name
from mlx_relay.worker.stage import WorkerStage


class Staged:
    """`path` cut into `ranges` (rank 0's first), every stage loaded as its rank loads it.

    `dtype`: every stage's weights cast to it after loading (a released model's dtype,
    where the tiny checkpoint is float32); `kv`: rank 0's KV quantization (the LOAD
    document's, as pipeline.py writes it). `housekeeping`: False leaves out two parts of
    a load that are not the stages' arithmetic, for tests of many families' steps: the
    measure of the caches' layout (memory.check_measured, for a family whose config does
    not tell it: a probe step of ~1000 positions, seconds on this CPU where a family's
    code reads values while building it) and the collection of an earlier model's garbage
    (the worker's unload: gc.collect, a fifth of a second each over a test session's heap,
    with no earlier model here). The layers, caches and steps are the ranks' own either
    way. `hops`: the last step's header as each rank
    sent it on (rank 0's first; the last rank's is what comes back to rank 0), for tests
    of what travels."""

    def __init__(
        self,
        path: Path,
        ranges: list[tuple[int, int]],
        dtype: mx.Dtype | None = None,
        kv: dict | None = None,
        *,
        housekeeping: bool = True,
    ):
        self.runner = StageRunner(on_ring=len(ranges) > 1)
        document = {
            "model": str(path),
            "ranges": [list(r) for r in ranges],
            "fingerprint": sharding.fingerprint(path),
            "kv": kv,
        }
        self.workers = [WorkerStage(rank, len(ranges)) for rank in range(1, len(ranges))]
        with contextlib.nullcontext() if housekeeping else _without_housekeeping():
            self.runner.load(path, *ranges[0], kv=kv)
            for worker in self.workers:
                worker.load(document)
        self.runner.loaded()
        for shard in self.shards if dtype is not None else ():
            shard.model.set_dtype(dtype)
        self.hops: list[hdr.StepHeader] = []

    @property
    def shards(self) -> list[sharding.Shard]:
        shards = [self.runner.shard, *(w.shard for w in self.workers)]
        assert all(s is not None for s in shards)
        return shards  # type: ignore[return-value]

    def logits(
        self,
        slot: int,
        offset: int,
        tokens: mx.array,
        prompt: PromptInputs | None = None,
        *,
        decode: bool = False,
    ) -> mx.array:
        """One sequence's forward step of `tokens` (1, n) at `offset` on `slot` through
        every stage; the logits at its last position (1, vocab). `prompt`: a prefill
        chunk's embeddings and side inputs (an image prompt's); `decode`: a step of the
        sequence's decode group (which, unlike a prefill chunk, goes on from what the
        sequence's prompt set, a multimodal-rope model's position delta)."""
        group = 0 if decode else hdr.NO_GROUP
        return self.step([slot], [offset], tokens, prompt, group=group)

    def step(
        self,
        slots: list[int],
        offsets: list[int],
        tokens: mx.array,
        prompt: PromptInputs | None = None,
        *,
        group: int = hdr.NO_GROUP,
    ) -> mx.array:
        """A forward step of `tokens` (one row per slot, each at its offset) through every
        stage, as the ring driver sends it: each sequence alone, or with `group` one decode
        group's rows as one batch; a two-pass model's step goes round twice (its first
        lap back to rank 0, `StageRunner.next_lap`, then every worker again). The logits
        at each row's last position (rows, vocab)."""
        header = hdr.StepHeader(
            cmd=hdr.CMD_FORWARD,
            flags=hdr.FLAG_WANT_OUTPUT,
            group=group,
            slots=list(slots),
            offsets=list(offsets),
            lengths=[tokens.shape[1]] * len(slots),
        )
        h, sides = self.runner.run(header, tokens, reuse_from=None, prompt=prompt)
        header.payload_kind = hdr.PAYLOAD_HIDDEN
        header.payload_dtype = dtype_name(h.dtype)
        header.payload_shape = tuple(h.shape)
        self.hops = []
        header, h = self._round(header, h, sides)
        if self.workers and self.runner.more_laps(header):
            header, h = self.runner.next_lap(header, h)
            header, h = self._round(header, h, [])
        return self.runner.logits(header, h)

    def _round(
        self, header: hdr.StepHeader, h: mx.array, sides: list[mx.array]
    ) -> tuple[hdr.StepHeader, mx.array]:
        """Each worker's `take` of a step rank 0 sent on; the header and state the last
        rank returns (each hop's header kept in `hops`)."""
        for worker in self.workers:
            self.hops.append(hdr.decode(hdr.encode(header)))  # (as sent on, kept)
            header = hdr.decode(hdr.encode(header))
            taken = worker.take(header, h, sides)
            assert taken.failure is None, f"rank {worker.rank}: {taken.failure}"
            h, sides = taken.out, taken.sides
        if self.workers:  # (what comes back to rank 0)
            self.hops.append(hdr.decode(hdr.encode(header)))
        return header, h

    def park(self, slots: list[int]) -> None:
        """The slots' sequences finished: their caches parked on every rank (a CMD_FREE
        with FLAG_PARK, as rank 0 sends it), out of any decode group."""
        self.runner.free(list(slots), park=True)
        for worker in self.workers:
            header = hdr.StepHeader(cmd=hdr.CMD_FREE, flags=hdr.FLAG_PARK, slots=list(slots))
            header.offsets = header.lengths = [0] * len(slots)  # (as the ring driver's)
            taken = worker.take(hdr.decode(hdr.encode(header)), None, [])
            assert taken.failure is None, f"rank {worker.rank}: {taken.failure}"


def greedy_forward(staged: Staged, slot: int = 0):
    """forward(tokens) -> logits: one sequence's successive steps on `slot` (a prefill,
    then decode steps), each starting where the last ended."""
    position = 0

    def forward(tokens: mx.array) -> mx.array:
        nonlocal position
        logits = staged.logits(slot, position, tokens, decode=position > 0)
        position += tokens.shape[1]
        return logits

    return forward


@contextlib.contextmanager
def _without_housekeeping():
    """Loads meanwhile measure no caches and collect no garbage (Staged's `housekeeping`)."""
    with (
        mock.patch.object(memory, "check_measured", lambda *args, **kwargs: None),
        mock.patch.object(gc, "collect", lambda *args, **kwargs: 0),
    ):
        yield
