"""Collective hops: a hop's payload carried by an all-sum of the two ranks it joins.

MLX's NCCL backend (CUDA) has collectives but no send or recv. An all-sum in which the
sender gives its payload and the receiver zeros of the same shape hands the receiver
the payload exactly (x + 0 == x; a -0.0 arrives as +0.0, which no layer tells apart),
and it runs on the GPU's own stream:
the kernels that read a receive wait for it on the device, launched ahead, with no CPU
stream, managed memory or host wait on the hop, each of which MLX 0.32.4's CUDA backend
puts on a ring hop (bench/RESULTS.md, sessions 10 and 11). An all-sum of a pair is a
point-to-point hop only where the pair is the whole group, so each hop has a
communicator of its own that joins exactly the two ranks it links.

With N ranks on CUDA GPUs of their own, every neighbouring pair of the ring (r, r+1),
the last rank's hop back to rank 0 included, gets an NCCL communicator split from the
world group (`pair_colorings`: two splits make every pair of an even ring, three of an
odd one; a rank left out of a split's pairs is alone in its group, which it never
uses). A rank sends on its pair with the next rank and receives on its pair with the
one before it, each communicator always on the same GPU stream of the rank, in step
order, so no collective waits on another's later work. Off CUDA (the ring backend on a
CPU, what the tests run) there is no split, so collective hops there join exactly two
ranks (the ring group itself).

Each direction has a communicator of its own (NCCL: the world group and a duplicate
split from it), and each rank posts its receives on a GPU stream of their own, so that
neither rank's stream holds a collective that waits for the other's later work (one
communicator on one stream per rank makes rank 0's next layers wait for the last step's
return). That is meant to let two steps in flight overlap; with MLX's CUDA graphs (on
by default) they still did not, and without them they mostly did (bench/RESULTS.md,
session 12): collective hops win single-stream decode, not throughput under load, so
adaptive hops (ring.py) use them for a step alone in flight, and for the hop out of rank
0 of the others.
Elsewhere (the ring backend on a CPU, what the tests run) both directions share the
ring group and the default stream, in the order they are posted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx

from mlx_relay.device import on_cuda

DEFAULT_NCCL_PORT = 50150  # rank 0's host: where NCCL's bootstrap listens (NCCL_PORT)


@dataclass
class PayloadGroups:
    """Where a rank's collective hops run: what it sends on, what it receives on."""

    send: mx.distributed.Group
    recv: mx.distributed.Group
    separate_streams: bool  # receives on a GPU stream of their own


def check_pair(ranks: int) -> None:
    """Off CUDA collective hops run on the ring group itself: only a pair makes it one hop."""
    if ranks != 2:
        raise ValueError(
            f"collective hops off CUDA join exactly 2 ranks (a hop is an all-sum of the "
            f"ring group); this cluster has {ranks}: use --hop-mode eager or ready"
        )


def pair_colorings(size: int) -> list[list[int]]:
    """Splits of a ring of `size` ranks (size > 2) that give every neighbouring pair
    (r, r+1 mod size) a group of its own: for each split, each rank's color (ranks of a
    color form a group). Pairs in one split share no rank; a rank in none of a split's
    pairs gets a color of its own. Even rings need two splits, odd ones three."""
    edges = list(range(size))  # edge e joins ranks e and e+1 (mod size)
    classes: list[list[int]] = [[], []] if size % 2 == 0 else [[], [], []]
    for e in edges:
        index = e % 2 if size % 2 == 0 or e < size - 1 else 2
        classes[index].append(e)
    colorings = []
    for chosen in classes:
        colors = [size + r for r in range(size)]  # alone unless in a pair below
        for e in chosen:
            colors[e] = colors[(e + 1) % size] = e
        colorings.append(colors)
    return colorings


def _pair_groups(world: mx.distributed.Group) -> tuple[mx.distributed.Group, mx.distributed.Group]:
    """This rank's (send, receive) communicators of an NCCL world of more than two
    ranks: its pair with the next rank and its pair with the one before it."""
    rank, size = world.rank(), world.size()
    send = recv = None
    for colors in pair_colorings(size):  # (every rank splits alike, in the same order)
        group = world.split(colors[rank], rank)
        if colors[rank] == rank % size and colors[(rank + 1) % size] == colors[rank]:
            send = group  # the pair (rank, rank + 1)
        before = (rank - 1) % size
        if colors[before] == before and colors[rank] == before:
            recv = group  # the pair (rank - 1, rank)
    assert send is not None and recv is not None, "every rank has both its pairs"
    return send, recv


def gpu_tag() -> int:
    """A number naming this rank's CUDA GPU (28 bits of its UUID), 0 off CUDA."""
    if not on_cuda():
        return 0
    uuid = str(mx.device_info().get("uuid", ""))
    digits = "".join(c for c in uuid.lower() if c in "0123456789abcdef")
    return int(digits[:7] or "1", 16) | 1


def gpu_tags(group: mx.distributed.Group) -> list[int]:
    """Every rank's `gpu_tag`, in rank order: a collective over `group` (the ring), so
    every rank must ask at the same point."""
    mine = mx.array([gpu_tag()], dtype=mx.int32)
    return mx.distributed.all_gather(mine, group=group, stream=mx.cpu).tolist()


def on_gpus_of_their_own(tags: list[int]) -> bool:
    """Whether every rank (`gpu_tags`; none: not known) computes on a CUDA GPU no other
    rank uses (NCCL refuses two ranks on one GPU)."""
    return bool(tags) and all(tags) and len(set(tags)) == len(tags)


def nccl_world(group: mx.distributed.Group, rank0_host: str) -> mx.distributed.Group:
    """An NCCL communicator of the same ranks as `group` (every rank on a CUDA GPU of its
    own), bootstrapped at rank 0's host (NCCL_PORT or DEFAULT_NCCL_PORT): a collective
    of every rank, so each must ask at the same point."""
    os.environ.setdefault("NCCL_HOST_IP", rank0_host)
    os.environ.setdefault("NCCL_PORT", str(DEFAULT_NCCL_PORT))
    os.environ["MLX_RANK"] = str(group.rank())
    os.environ["MLX_WORLD_SIZE"] = str(group.size())
    return mx.distributed.init(strict=True, backend="nccl")


def payload_groups(group: mx.distributed.Group, rank0_host: str, tags: list[int]) -> PayloadGroups:
    """The groups a rank's collective hops use, given every rank's `gpu_tags`: on CUDA
    GPUs of their own NCCL pairs (bootstrapped at rank 0's host, NCCL_PORT or
    DEFAULT_NCCL_PORT); on no CUDA rank `group` itself (two ranks only)."""
    if not any(tags):
        check_pair(group.size())
        return PayloadGroups(group, group, separate_streams=False)
    if not on_gpus_of_their_own(tags):
        raise ValueError(
            "collective hops need both ranks on CUDA GPUs of their own (give each rank "
            "its GPU with CUDA_VISIBLE_DEVICES), or neither on CUDA; use --hop-mode eager"
        )
    forward = nccl_world(group, rank0_host)  # rank 0 -> rank 1
    if group.size() > 2:
        send, recv = _pair_groups(forward)
        return PayloadGroups(send=send, recv=recv, separate_streams=True)
    back = forward.split(0)  # rank 1 -> rank 0: a communicator of its own
    if group.rank() == 0:
        return PayloadGroups(send=forward, recv=back, separate_streams=True)
    return PayloadGroups(send=back, recv=forward, separate_streams=True)
