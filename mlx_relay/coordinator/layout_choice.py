"""`--tensor-parallel auto`: the layout a load gets, from what it measures at load.

A single stream's token goes through every layer once. As a pipeline, each rank reads
its own layers' weights in turn, so a token costs about the layers' weight bytes over
one rank's weight-reading speed (plus a hop per rank, small beside it). Split across T
ranks, each rank reads 1/T of every layer at once, but every layer ends in two all-sums
of the hidden state across the group (after attention, after the MLP) and the step's
input is broadcast once: 2L + 1 collectives a token, each as long as the link makes it.

    pipeline ~ W / B
    tensor   ~ W / (T B) + (2L + 1) c

W: the layers' weight bytes; B: rank 0's measured weight-reading speed (model/speed.py);
L: the layers; c: one all-sum of a token's hidden state over the group, timed at load on
the group itself (TensorGroup.time_all_sum). The split is chosen where its estimate is
below MARGIN of the pipeline's: what the estimate leaves out (each rank's host work per
step, which a split does not divide; measured on GPUs, bench/RESULTS.md) counts against
it. With the figures measured on 2 H200s this picks the split for the Llama-3-70B shape
(measured 1.19x) and the pipeline for the 8B shape (the split measured 0.48x).

Ranks of one machine without GPUs of their own share its memory and cores: a split
cannot read the weights any faster there, and is never chosen (the figures are still
measured and shown).
"""

from __future__ import annotations

from dataclasses import dataclass

MARGIN = 0.8  # the split's estimate must be below this share of the pipeline's


@dataclass(frozen=True)
class Choice:
    """What `auto` chose, and the figures it chose by (for status and the log)."""

    tensor: int  # ranks splitting every layer (1: a pipeline)
    all_sum_s: float  # one all-sum of a token's hidden state over the group
    read_bytes_per_s: float  # rank 0's weight-reading speed
    pipeline_s: float  # a token's estimate as a pipeline
    tensor_s: float  # and split across the group
    why: str = ""  # why the split is not chosen ('' where it is)

    def describe(self) -> str:
        figures = (
            f"all-sum {self.all_sum_s * 1e6:.0f} us, weights read at "
            f"{self.read_bytes_per_s / 1e9:.1f} GB/s: a token ~{self.pipeline_s * 1e3:.1f} ms "
            f"as a pipeline, ~{self.tensor_s * 1e3:.1f} ms split"
        )
        chosen = "split" if self.tensor > 1 else f"pipeline, {self.why}"
        return f"auto ({figures}): {chosen}"


def choose(
    weights: int,
    layers: int,
    ranks: int,
    all_sum_s: float,
    read_bytes_per_s: float,
    *,
    shared_machine: bool,
) -> Choice:
    """The layout for a model of `weights` bytes in `layers` layers on `ranks` ranks
    (see the module's docstring); `shared_machine`: ranks share a machine's memory."""
    pipeline_s = weights / read_bytes_per_s
    tensor_s = weights / (ranks * read_bytes_per_s) + (2 * layers + 1) * all_sum_s
    figures = dict(
        all_sum_s=all_sum_s,
        read_bytes_per_s=read_bytes_per_s,
        pipeline_s=pipeline_s,
        tensor_s=tensor_s,
    )
    if shared_machine:
        why = "the ranks share one machine's memory: a split reads no faster"
        return Choice(tensor=1, why=why, **figures)
    if tensor_s >= MARGIN * pipeline_s:
        why = f"the split's all-sums would cost more than it saves (below {MARGIN:.0%} needed)"
        return Choice(tensor=1, why=why, **figures)
    return Choice(tensor=ranks, **figures)
