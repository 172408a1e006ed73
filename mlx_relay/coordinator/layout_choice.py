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
the group, timed at load on the group itself (TensorGroup.time_all_sum).

On 4 or more ranks (an even number) a third layout is weighed: a grid of pairs, ranks
1+2, 3+4, ... each splitting the layers of one pipeline stage over the link between
them, the stages passing the hidden state on as a pipeline does:

    grid     ~ L s / 2 + (2L + N/2) p

p: the slowest pair's all-sum, each pair timed over its own link. Where the ranks are
cabled in pairs by a fast link (Thunderbolt 5) and joined by a slow one (Ethernet),
p is far below c and the grid wins; where every link is alike, splitting over all the
ranks does. A split is chosen where its estimate is below MARGIN of the pipeline's
(what the estimate leaves out counts against it), the smaller of the two where both
are. On two H200s (bench/RESULTS.md) the estimate's terms match what was measured: the
Llama-3-70B shape's token 41 ms unsplit, 31 ms split (~20.5 + 161 x 0.07 ms); the 8B
shape's 5.5 ms unsplit, 9 ms split.

Ranks of one machine without GPUs of their own share its memory and cores: a split
cannot read the weights any faster there, and is never chosen (the figures are still
measured and shown); nor a grid whose pairs share a machine each.
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
    why: str = ""  # why no split is chosen ('' where one is)
    stages: int = 1  # pipeline stages of the chosen split (a grid of pairs: more than 1)
    pair_sum_s: float = 0.0  # the slowest pair's all-sum (0: no grid of pairs weighed)
    grid_s: float = 0.0  # a token's estimate as a grid of pairs

    def describe(self) -> str:
        figures = (
            f"all-sum {self.all_sum_s * 1e6:.0f} us, a layer's decode step "
            f"{self.layer_s * 1e6:.0f} us: a token ~{self.pipeline_s * 1e3:.1f} ms "
            f"as a pipeline, ~{self.tensor_s * 1e3:.1f} ms split"
        )
        if self.pair_sum_s:
            figures += (
                f"; a pair's all-sum {self.pair_sum_s * 1e6:.0f} us: "
                f"~{self.grid_s * 1e3:.1f} ms as a grid of pairs"
            )
        if self.tensor == 1:
            chosen = f"pipeline, {self.why}"
        else:
            chosen = "grid of pairs" if self.stages > 1 else "split"
        return f"auto ({figures}): {chosen}"


def choose(
    layer_s: float,
    layers: int,
    ranks: int,
    all_sum_s: float,
    *,
    shared_machine: bool,
    split_refused: str = "",
    pair_sum_s: float | None = None,
    pairs_apart: bool = False,
    pairs_refused: str = "",
) -> Choice:
    """The layout for a model of `layers` layers, each `layer_s` a decode step, on `ranks`
    ranks (see the module's docstring); `shared_machine`: ranks share a machine's memory;
    `split_refused`: why the layers cannot split over all the ranks ('' where they can).
    With `pair_sum_s` (the slowest pair's all-sum) a grid of pairs is weighed too:
    `pairs_apart`, every pair's two ranks on machines of their own; `pairs_refused`, why
    the layers cannot split over two."""
    pipeline_s = layers * layer_s
    tensor_s = pipeline_s / ranks + (2 * layers + 1) * all_sum_s
    grid_s = 0.0
    if pair_sum_s is not None:
        grid_s = pipeline_s / 2 + (2 * layers + ranks // 2) * pair_sum_s
    figures = dict(
        all_sum_s=all_sum_s,
        layer_s=layer_s,
        pipeline_s=pipeline_s,
        tensor_s=tensor_s,
        pair_sum_s=pair_sum_s or 0.0,
        grid_s=grid_s,
    )
    candidates: list[tuple[float, int]] = []  # (a token's estimate, ranks splitting a layer)
    whys: list[str] = []
    if split_refused:
        whys.append(split_refused)
    elif shared_machine:
        whys.append("the ranks share one machine's memory: a split reads no faster")
    elif tensor_s >= MARGIN * pipeline_s:
        whys.append(
            f"the split's all-sums would cost more than it saves (below {MARGIN:.0%} needed)"
        )
    else:
        candidates.append((tensor_s, ranks))
    if pair_sum_s is not None:
        if pairs_refused:
            whys.append(f"pairs: {pairs_refused}")
        elif not pairs_apart:
            whys.append("each pair shares a machine's memory")
        elif grid_s >= MARGIN * pipeline_s:
            whys.append("the pairs' all-sums would cost more than they save")
        else:
            candidates.append((grid_s, 2))
    if not candidates:
        return Choice(tensor=1, why="; ".join(whys), **figures)
    _, tensor = min(candidates)
    return Choice(tensor=tensor, stages=ranks // tensor, **figures)
