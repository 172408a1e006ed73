"""A model's stages chained in one process, run by the ranks' own code.

Rank 0's part of a step is the coordinator's `StageRunner` (its input, the side arrays a
family takes, its layers, the LM head); each later rank's is the worker loop's own
`WorkerStage.take`, loaded from the same LOAD document rank 0 sends. Only the transport
is left out: every header still goes through the wire format between stages. So an
in-process test of a family's split checks what a cluster runs, in milliseconds.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from mlx_relay.coordinator.runner import StageRunner
from mlx_relay.model import sharding
from mlx_relay.model.step_inputs import PromptInputs
from mlx_relay.protocol import header as hdr
from mlx_relay.transport.ring import dtype_name
from mlx_relay.worker.stage import WorkerStage


class Staged:
    """`path` cut into `ranges` (rank 0's first), every stage loaded as its rank loads it.

    `dtype`: every stage's weights cast to it after loading (a released model's dtype,
    where the tiny checkpoint is float32). `hops`: the last step's header as each rank
    sent it on (rank 0's first; the last rank's is what comes back to rank 0), for tests
    of what travels."""

    def __init__(self, path: Path, ranges: list[tuple[int, int]], dtype: mx.Dtype | None = None):
        self.runner = StageRunner(on_ring=len(ranges) > 1)
        self.runner.load(path, *ranges[0], kv=None)
        self.runner.loaded()
        document = {
            "model": str(path),
            "ranges": [list(r) for r in ranges],
            "fingerprint": sharding.fingerprint(path),
            "kv": None,
        }
        self.workers = [WorkerStage(rank, len(ranges)) for rank in range(1, len(ranges))]
        for worker in self.workers:
            worker.load(document)
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
        header = hdr.StepHeader(
            cmd=hdr.CMD_FORWARD,
            flags=hdr.FLAG_WANT_OUTPUT,
            group=0 if decode else hdr.NO_GROUP,
            slots=[slot],
            offsets=[offset],
            lengths=[tokens.shape[1]],
        )
        h, sides = self.runner.run(header, tokens, reuse_from=None, prompt=prompt)
        header.payload_kind = hdr.PAYLOAD_HIDDEN
        header.payload_dtype = dtype_name(h.dtype)
        header.payload_shape = tuple(h.shape)
        self.hops = []
        for worker in self.workers:
            self.hops.append(hdr.decode(hdr.encode(header)))  # (as sent on, kept)
            header = hdr.decode(hdr.encode(header))
            taken = worker.take(header, h, sides)
            assert taken.failure is None, f"rank {worker.rank}: {taken.failure}"
            h, sides = taken.out, taken.sides
        if self.workers:  # (what comes back to rank 0)
            self.hops.append(hdr.decode(hdr.encode(header)))
        return self.runner.logits(header, h)


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
