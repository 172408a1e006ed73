"""Collective hops: a hop's payload carried by an all-sum of the two ranks it joins.

MLX's NCCL backend (CUDA) has collectives but no send or recv. An all-sum in which the
sender gives its payload and the receiver zeros of the same shape hands the receiver
the payload exactly (x + 0 == x; a -0.0 arrives as +0.0, which no layer tells apart),
and it runs on the GPU's own stream:
the kernels that read a receive wait for it on the device, launched ahead, with no CPU
stream, managed memory or host wait on the hop, each of which MLX 0.32.4's CUDA backend
puts on a ring hop (bench/RESULTS.md, sessions 10 and 11). An all-sum of a pair is a
point-to-point hop only where the pair is the whole group, so collective hops join
exactly two ranks.

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

DEFAULT_NCCL_PORT = 50150  # rank 0's host: where NCCL's bootstrap listens (NCCL_PORT)


@dataclass
class PayloadGroups:
    """Where a rank's collective hops run: what it sends on, what it receives on."""

    send: mx.distributed.Group
    recv: mx.distributed.Group
    separate_streams: bool  # receives on a GPU stream of their own


def on_cuda() -> bool:
    cuda = getattr(mx, "cuda", None)  # (MLX builds without the module: not CUDA)
    return mx.default_device() == mx.gpu and cuda is not None and cuda.is_available()


def check_pair(ranks: int) -> None:
    if ranks != 2:
        raise ValueError(
            f"collective hops join exactly 2 ranks (a hop is an all-sum of the pair); "
            f"this cluster has {ranks}: use --hop-mode eager or ready"
        )


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


def payload_groups(group: mx.distributed.Group, rank0_host: str, tags: list[int]) -> PayloadGroups:
    """The groups a rank's collective hops use, given every rank's `gpu_tags`: on CUDA
    GPUs of their own an NCCL pair (bootstrapped at rank 0's host, NCCL_PORT or
    DEFAULT_NCCL_PORT); on no CUDA rank `group` itself."""
    check_pair(group.size())
    if not any(tags):
        return PayloadGroups(group, group, separate_streams=False)
    if not on_gpus_of_their_own(tags):
        raise ValueError(
            "collective hops need both ranks on CUDA GPUs of their own (give each rank "
            "its GPU with CUDA_VISIBLE_DEVICES), or neither on CUDA; use --hop-mode eager"
        )
    os.environ.setdefault("NCCL_HOST_IP", rank0_host)
    os.environ.setdefault("NCCL_PORT", str(DEFAULT_NCCL_PORT))
    os.environ["MLX_RANK"] = str(group.rank())
    os.environ["MLX_WORLD_SIZE"] = str(group.size())
    forward = mx.distributed.init(strict=True, backend="nccl")  # rank 0 -> rank 1
    back = forward.split(0)  # rank 1 -> rank 0: a communicator of its own
    if group.rank() == 0:
        return PayloadGroups(send=forward, recv=back, separate_streams=True)
    return PayloadGroups(send=back, recv=forward, separate_streams=True)
