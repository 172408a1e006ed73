"""The tensor group: ranks that split every layer of one stage between them.

mlx-lm's `model.shard(group)` gives each rank a slice of every attention and MLP
projection (MLX's sharded linear layers) and sums the slices' outputs across the group
with an all-sum, twice a layer. Every rank of the group must therefore run the same
step at the same time, on the same input: rank 0 decides the step as always, and its
header goes round the ring alone (FLAG_TENSOR: the announcement out, the
acknowledgement back); the hidden state enters the layers through `broadcast`, an
all-sum to which rank 0 gives the state and every other rank zeros (x + 0 == x, so
every rank holds rank 0's values exactly).

Where the group's collectives run: on CUDA GPUs of their own, an NCCL communicator of
the ranks (collective.nccl_world; NVLink where the GPUs share it); elsewhere the ring
group itself (MLX's ring backend on CPUs and Macs over Thunderbolt or Ethernet; JACCL's
RDMA where launched with it).

A stage x tensor grid (`--tensor-parallel T` on N ranks, 1 < T < N): N/T pipeline
stages of T consecutive ranks, each stage's ranks a sub-group of their own
(`Group.split`, which MLX's NCCL and MPI backends have and its ring and JACCL backends
have not: mlx 0.32.4, "[ring] Group split not supported"; there a stage of two is a
pair whose all-sums are exchanges over their link, pairs.py). A step's header goes round
the whole ring; the hidden state hops from a stage's last rank to the next stage's
first over the ring, as in a pipeline, and that rank gives it to its stage by the
broadcast above (worker/loop.py). Under MPI a sub-group still alive when the process
ends makes MPI abort (MPI_Comm_free after MPI_Finalize): a rank that exits cleanly
finalizes MPI itself and leaves without destructors (launch/serve.py's _mpi_finalize).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from mlx_relay.protocol import header as hdr
from mlx_relay.transport import pairs
from mlx_relay.transport.collective import nccl_world, on_gpus_of_their_own
from mlx_relay.transport.pairs import PairGroup
from mlx_relay.transport.ring import PAIRED_MODES, mx_dtype

# `--tensor-parallel auto`: every rank one stage, or (on 4 or more ranks, an even number)
# a grid of pairs, where the load's measurements say a split pays
# (coordinator/layout_choice.py), else a pipeline.
AUTO = 0


class TensorLayoutError(ValueError):
    """A `--tensor-parallel` this cluster cannot have (the message says why)."""


def parse_tensor_parallel(text: str) -> int:
    """`--tensor-parallel`'s value: a number of ranks, or `auto` (AUTO)."""
    if text.strip().lower() == "auto":
        return AUTO
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected a number of ranks or auto, not {text!r}") from None
    if value < 1:
        raise ValueError(f"expected 1 or more ranks, or auto, not {value}")
    return value


def group_size(tensor: int, ranks: int) -> int:
    """The ranks a tensor group of `--tensor-parallel tensor` holds (auto: every rank)."""
    return ranks if tensor == AUTO else tensor


def stage_count(tensor: int, ranks: int) -> int:
    """The pipeline stages `--tensor-parallel tensor` makes of `ranks`: what needs a layer
    range each (auto, or a `tensor` that does not divide them: as many as the ranks)."""
    if tensor in (AUTO, 1) or tensor < 1 or ranks % tensor:
        return ranks
    return ranks // tensor


@dataclass
class TensorGroup:
    """This rank's tensor group: `group` (every rank of the stage), `backend` (what its
    collectives run over, for status and logs), `auto`: used only where a load's
    measurements say a split pays (coordinator/layout_choice.py)."""

    group: mx.distributed.Group | PairGroup
    backend: str
    auto: bool = False  # --tensor-parallel auto: each load decides whether to split
    why_not: str = ""  # why `auto` may not split on this cluster ('' where it may)
    stages: int = 1  # pipeline stages of such groups (a stage x tensor grid: more than 1)
    # auto on 4 or more ranks, an even number: this rank's pair in a grid of pairs, the
    # other split `auto` weighs (each pair's all-sums over its own link)
    pairs: TensorGroup | None = None

    @property
    def size(self) -> int:
        return self.group.size()

    def of_size(self, ranks: int) -> TensorGroup | None:
        """This rank's group of `ranks` ranks: this one, or auto's grid of pairs (None:
        neither), as a load laid out to split over `ranks` uses it."""
        for group in (self, self.pairs):
            if group is not None and group.size == ranks:
                return group
        return None

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def grid(self) -> bool:
        """Whether the group is one stage of several (its hidden state comes from the
        stage before over the ring, and goes on to the next)."""
        return self.stages > 1

    @property
    def first(self) -> bool:
        """Whether this rank gives its stage the step's input (the broadcast's root)."""
        return self.rank == 0

    @property
    def last(self) -> bool:
        """Whether this rank sends its stage's output on (in a grid; else nobody does)."""
        return self.grid and self.rank == self.size - 1

    def broadcast(self, x: mx.array) -> mx.array:
        """Rank 0 of the group gives `x`; every rank gets it (an all-sum of it and zeros)."""
        if self.rank != 0:
            x = mx.zeros_like(x)
        return mx.distributed.all_sum(x, group=self.group)

    def receive(self, header: hdr.StepHeader) -> tuple[mx.array, list[mx.array]]:
        """A peer's side of rank 0's broadcasts for a FLAG_TENSOR step: the hidden state
        whose shape and dtype the header's payload fields give, then each side array the
        header lists, in order."""
        dtype = mx_dtype(header.payload_dtype)
        h = mx.distributed.all_sum(mx.zeros(header.payload_shape, dtype), group=self.group)
        sides = [
            mx.distributed.all_sum(mx.zeros(side.shape, mx_dtype(side.dtype)), group=self.group)
            for side in header.sides
        ]
        return h, sides

    def send_all(self, sides: Sequence[mx.array]) -> list[mx.array]:
        """Rank 0's side of `receive` for the side arrays."""
        return [self.broadcast(side) for side in sides]

    def time_all_sum(self, shape: tuple[int, ...], dtype: mx.Dtype, chain: int = 16) -> float:
        """Seconds one all-sum of an array of `shape` takes over the group, as a split
        layer's are run: `chain` of them each on the one before (so none overlaps the
        next), the best of three runs after a warm-up. Every rank of the group must call
        it at once, with the same arguments (FLAG_TENSOR's CMD_TIME_ALL_SUM)."""
        x = mx.ones(shape, dtype)
        scale = 1.0 / self.size  # (keeps the values where they started)
        best = float("inf")
        for run in range(4):
            start = time.perf_counter()
            y = x
            for _ in range(chain):
                y = mx.distributed.all_sum(y, group=self.group) * scale
            mx.eval(y)
            if run:  # (the first: a warm-up)
                best = min(best, (time.perf_counter() - start) / chain)
        return best


def check_layout(
    tensor: int, ranks: int, hop_mode: str = "auto", layers: str | None = None
) -> None:
    """TensorLayoutError unless `tensor` ranks a stage fit a cluster of `ranks` as built:
    1 (a pipeline), every rank one stage (auto: either, chosen at load), or stages of
    `tensor` ranks (a grid, where the backend splits groups: check_grid_backend); whose
    steps send headers alone round the ring inside a stage (so `hop_mode` must not be
    one that pairs ranks to carry payloads), and no `--layers` range a rank (`layers`):
    the two ask for different layouts (auto alone takes `--layers` as a pipeline's)."""
    auto, tensor = tensor == AUTO, group_size(tensor, ranks)
    if tensor > 1 and hop_mode in PAIRED_MODES and not auto:  # (auto: then no split)
        raise TensorLayoutError(
            f"--tensor-parallel sends headers alone round the ring inside a stage: "
            f"--hop-mode {hop_mode} pairs ranks to carry payloads (use auto, eager or ready)"
        )
    if tensor > 1 and layers and not auto:  # (auto: a pipeline where --layers is given)
        raise TensorLayoutError(
            f"--tensor-parallel {tensor} splits every layer across the ranks, and --layers "
            f"{layers} gives each rank a range of them: give one or the other"
        )
    if tensor < 1:
        raise TensorLayoutError(f"--tensor-parallel {tensor}: expected 1 or more")
    if tensor == 1 or tensor == ranks:
        return
    if tensor > ranks or ranks % tensor:
        raise TensorLayoutError(
            f"--tensor-parallel {tensor} does not divide a cluster of {ranks} ranks into stages"
        )


def check_grid_backend(tensor: int, ranks: int, backend: str, splits: bool) -> None:
    """TensorLayoutError where `--tensor-parallel tensor` on `ranks` asks for a stage x
    tensor grid of stages of more than two and the ranks' groups cannot be split
    (`splits`: MLX's MPI backend, or NCCL on CUDA GPUs of their own; not its ring or
    JACCL backends, where a stage of two is a pair: pairs.py)."""
    if tensor in (AUTO, 1, 2, ranks) or splits:
        return
    raise TensorLayoutError(grid_refusal(tensor, ranks, backend))


def grid_refusal(tensor: int, ranks: int, backend: str) -> str:
    return (
        f"--tensor-parallel {tensor} on {ranks} ranks asks for {ranks // tensor} stages of "
        f"{tensor}: a stage of more than two ranks needs them as an mx.distributed "
        f"sub-group (Group.split), which MLX's {backend} backend does not have; launch with "
        f'MPI (a hostfile with "backend": "mpi") or on CUDA GPUs of their own (NCCL), or use '
        f"stages of 2, --tensor-parallel {ranks} (one stage) or 1 (a pipeline)"
    )


def tensor_group(
    world: mx.distributed.Group,
    tensor: int,
    rank0_host: str,
    tags: list[int],
    backend: str = "ring",
) -> TensorGroup | None:
    """This rank's tensor group for `--tensor-parallel tensor` (check_layout first; None
    for 1), given every rank's gpu_tags: NCCL where every rank has a CUDA GPU of its
    own, else the world group itself (of `backend`); in a grid, the sub-group of this
    rank's stage split from it (TensorLayoutError where the backend cannot split); for
    auto on 4 or more ranks, an even number, the whole group with this rank's pair as
    `pairs` (the grid auto weighs). A collective of every rank on CUDA, and of every
    rank for a grid or auto's pairs."""
    size = world.size()
    check_layout(tensor, size)
    auto, tensor = tensor == AUTO, group_size(tensor, size)
    if tensor == 1:
        return None
    if on_gpus_of_their_own(tags):
        group, backend = nccl_world(world, rank0_host), "nccl"
    elif any(tags):
        raise TensorLayoutError(
            "tensor parallelism on CUDA needs every rank on a GPU of its own (give each "
            "rank its GPU with CUDA_VISIBLE_DEVICES)"
        )
    else:
        group = world
    if tensor < size:
        return stage_group(group, tensor, backend)
    whole = TensorGroup(group, backend if backend == "nccl" else "world", auto)
    if auto and size >= 4 and size % 2 == 0:  # (auto's other split: a grid of pairs)
        whole.pairs = stage_group(group, 2, backend)
    return whole


def stage_group(group: mx.distributed.Group, tensor: int, backend: str) -> TensorGroup:
    """This rank's stage of `tensor` consecutive ranks of `group` (stage s: ranks s*T ..
    s*T + T-1): a sub-group split from it, or where the backend cannot split, a pair
    (pairs.py; TensorLayoutError for stages of more than two there). A collective of
    every rank of `group` where the backend splits."""
    size, rank = group.size(), group.rank()
    try:
        stage: mx.distributed.Group | PairGroup = group.split(rank // tensor, rank % tensor)
        how = f"{backend}, stages of {tensor}"
    except RuntimeError as e:
        if tensor != 2:
            raise TensorLayoutError(f"{grid_refusal(tensor, size, backend)} ({e})") from None
        pairs.install()  # (no split here: a pair's all-sums are exchanges, pairs.py)
        stage, how = PairGroup(group, rank - rank % 2), f"{backend}, stages of 2 (pairs)"
    return TensorGroup(stage, how, stages=size // tensor)
