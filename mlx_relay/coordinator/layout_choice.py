"""`--tensor-parallel auto`: the layout a load gets, from what it measures at load.

A single stream's token goes through every layer once. As a pipeline, the ranks run
their layers in turn, so a token costs about L layers' decode steps (plus a hop per
rank, small beside them). Split across T ranks, each rank runs 1/T of every layer at
once, but every layer ends in two all-sums of the hidden state across the group (after
attention, after the MLP) and the step's input is broadcast once: 2L + 1 collectives a
token, each as long as the link makes it.

    pipeline ~ L s
    tensor   ~ L s / T + (2L + 1) c

s: one decode step of the model's first layer, timed on rank 0 at load
(model/layer_timing.py); L: the layers; c: one all-sum of a token's hidden state over
the group, timed at load on the group itself (TensorGroup.time_all_sum). The split is
chosen where its estimate is below MARGIN of the pipeline's: what the estimate leaves
out counts against it. On two H200s (bench/RESULTS.md) the estimate's terms match what
was measured: the Llama-3-70B shape's token 41 ms unsplit, 31 ms split (~20.5 + 161 x
0.07 ms); the 8B shape's 5.5 ms unsplit, 9 ms split.

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
    layer_s: float  # one decode step of one layer on rank 0
    pipeline_s: float  # a token's estimate as a pipeline
    tensor_s: float  # and split across the group
    why: str = ""  # why the split is not chosen ('' where it is)

    def describe(self) -> str:
        figures = (
            f"all-sum {self.all_sum_s * 1e6:.0f} us, a layer's decode step "
            f"{self.layer_s * 1e6:.0f} us: a token ~{self.pipeline_s * 1e3:.1f} ms "
            f"as a pipeline, ~{self.tensor_s * 1e3:.1f} ms split"
        )
        chosen = "split" if self.tensor > 1 else f"pipeline, {self.why}"
        return f"auto ({figures}): {chosen}"


def choose(
    layer_s: float,
    layers: int,
    ranks: int,
    all_sum_s: float,
    *,
    shared_machine: bool,
) -> Choice:
    """The layout for a model of `layers` layers, each `layer_s` a decode step, on `ranks`
    ranks (see the module's docstring); `shared_machine`: ranks share a machine's memory."""
    pipeline_s = layers * layer_s
    tensor_s = pipeline_s / ranks + (2 * layers + 1) * all_sum_s
    figures = dict(
        all_sum_s=all_sum_s,
        layer_s=layer_s,
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
