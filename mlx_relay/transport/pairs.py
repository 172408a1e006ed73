"""A stage of two ranks as a tensor group where the backend cannot split groups.

MLX's ring and JACCL backends (the Macs' Thunderbolt and Ethernet links) have no
`Group.split`, so a stage x tensor grid's stages cannot each get a group of their own
there. Two neighbouring ranks of the ring need none: an all-sum of two is an exchange,
each rank sending its part to the other over their link and adding what it receives.
Floating-point addition of two values is commutative, so `mine + theirs` on one rank
and `theirs + mine` on the other are both, bit for bit, what MLX's all-sum of the pair
gives, and the tokens stay those of mlx-lm's split generation on two ranks.

`PairGroup` stands in for an `mx.distributed.Group` of the two (size, rank): mlx-lm's
`shard(group)` slices the weights by them, and MLX's sharded layers then call
`mx.distributed.all_sum(x, group=...)` with it. `install` makes that call (and
`all_gather`, which some families' shards use) route a PairGroup here and anything else
to MLX, once, in a process that has a pair. A send runs on a CPU stream of its own
(made per thread: MLX streams belong to the thread that made them), so both ranks send
at once and neither waits on its receive before its send has gone. Stages of more than
two ranks need a real sub-group (MPI, NCCL).
"""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx


class PairGroup:
    """Ranks `first` and `first + 1` of `world` as a group of two (see the module)."""

    def __init__(self, world: mx.distributed.Group, first: int) -> None:
        self.world = world
        self._rank = world.rank() - first
        if self._rank not in (0, 1):
            raise ValueError(f"rank {world.rank()} is not in the pair of {first} and {first + 1}")
        self.peer = first + 1 - self._rank
        self._streams = threading.local()

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return self._rank

    def _send_stream(self) -> mx.Stream:
        stream = getattr(self._streams, "send", None)
        if stream is None:
            stream = self._streams.send = mx.new_stream(mx.cpu)
        return stream

    def _exchange(self, x: mx.array) -> mx.array:
        """The peer's `x` (this rank's sent to it meanwhile)."""
        sent = mx.distributed.send(x, self.peer, group=self.world, stream=self._send_stream())
        theirs = mx.distributed.recv_like(x, self.peer, group=self.world)
        return mx.depends(theirs, sent)

    def all_sum(self, x: mx.array) -> mx.array:
        """The pair's sum of `x`, in rank order (as MLX's all-sum of two gives it)."""
        theirs = self._exchange(x)
        return x + theirs if self._rank == 0 else theirs + x

    def all_gather(self, x: mx.array) -> mx.array:
        """Both ranks' `x` joined along the first axis, in rank order."""
        theirs = self._exchange(x)
        parts = [x, theirs] if self._rank == 0 else [theirs, x]
        return mx.concatenate(parts, axis=0)


_mlx_all_sum = mx.distributed.all_sum
_mlx_all_gather = mx.distributed.all_gather


def _all_sum(x: mx.array, *args: Any, group: Any = None, **kwargs: Any) -> mx.array:
    if isinstance(group, PairGroup):
        return group.all_sum(x)
    return _mlx_all_sum(x, *args, group=group, **kwargs)


def _all_gather(x: mx.array, *args: Any, group: Any = None, **kwargs: Any) -> mx.array:
    if isinstance(group, PairGroup):
        return group.all_gather(x)
    return _mlx_all_gather(x, *args, group=group, **kwargs)


def install() -> None:
    """Route MLX's all-sum and all-gather of a PairGroup here (see the module); every
    other group's still reach MLX's own."""
    mx.distributed.all_sum = _all_sum
    mx.distributed.all_gather = _all_gather
