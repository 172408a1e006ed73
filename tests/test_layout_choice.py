"""`--tensor-parallel auto`'s rule (coordinator/layout_choice.py), on the figures it is
given: the split where its all-sums cost less than the layer work it spares each rank,
the pipeline elsewhere and wherever the ranks share one machine's memory."""

from __future__ import annotations

import pytest

from mlx_relay.coordinator.layout_choice import MARGIN, choose
from mlx_relay.model.layer_timing import decode_step_seconds


def test_the_70b_shape_on_two_h200s_splits_and_the_8b_shape_does_not():
    """Figures measured on 2 H200s (bench/RESULTS.md): an all-sum of the hidden state
    ~70 us; a token of the 4-bit 70B shape (80 layers) 41 ms unsplit, of the 8B shape
    (32 layers) 5.5 ms. The split measured 1.30x on the first and 0.60x on the second."""
    big = choose(41e-3 / 80, 80, 2, 70e-6, shared_machine=False)
    assert big.tensor == 2 and big.why == ""
    assert big.tensor_s < MARGIN * big.pipeline_s
    assert big.tensor_s == pytest.approx(31.8e-3, rel=0.02)  # (measured: 31.3 ms)
    small = choose(5.5e-3 / 32, 32, 2, 70e-6, shared_machine=False)
    assert small.tensor == 1 and "cost more than it saves" in small.why
    assert "pipeline" in small.describe() and "70 us" in small.describe()


def test_ranks_of_one_machine_never_split():
    shared = choose(41e-3 / 80, 80, 2, 70e-6, shared_machine=True)
    assert shared.tensor == 1 and "share one machine" in shared.why
    assert shared.tensor_s < shared.pipeline_s  # (the figures said otherwise: still no)


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_estimates(ranks):
    choice = choose(0.4, 10, ranks, 1e-4, shared_machine=False)
    assert choice.pipeline_s == pytest.approx(4.0)
    assert choice.tensor_s == pytest.approx(4.0 / ranks + 21 * 1e-4)
    assert choice.tensor == ranks


def test_four_macs_cabled_in_fast_pairs_run_a_grid_of_pairs():
    """Four ranks whose pairs share a fast link and whose pairs are joined by a slow one:
    the pairs' all-sums cost far less than an all-sum over all four (which crosses the
    slow links), so a grid of pairs beats both the 4-way split and the pipeline. Where
    every link is alike, splitting over all four wins; where the pairs share a machine
    each, or the layers cannot split over two, the grid is not chosen, and says why."""
    layer, layers = 0.5e-3, 80  # (a 70B's layer: a token ~40 ms as a pipeline)
    fast_pairs = choose(
        layer, layers, 4, 400e-6, shared_machine=False, pair_sum_s=40e-6, pairs_apart=True
    )
    assert (fast_pairs.tensor, fast_pairs.stages) == (2, 2), fast_pairs.describe()
    assert fast_pairs.grid_s == pytest.approx(40e-3 / 2 + (160 + 2) * 40e-6)
    assert fast_pairs.grid_s < fast_pairs.pipeline_s < fast_pairs.tensor_s  # (4-way: worse)
    assert fast_pairs.describe().endswith(": grid of pairs")
    assert "a pair's all-sum 40 us" in fast_pairs.describe()
    alike = choose(
        layer, layers, 4, 50e-6, shared_machine=False, pair_sum_s=40e-6, pairs_apart=True
    )
    assert (alike.tensor, alike.stages) == (4, 1) and alike.describe().endswith(": split")
    shared = choose(
        layer, layers, 4, 400e-6, shared_machine=True, pair_sum_s=40e-6, pairs_apart=False
    )
    assert shared.tensor == 1 and "each pair shares a machine" in shared.why
    refused = choose(
        layer, layers, 4, 400e-6, shared_machine=False, pair_sum_s=40e-6, pairs_apart=True,
        pairs_refused="mlx-lm's gemma3_text has no shard(): its layers cannot be split",
    )  # fmt: skip
    assert refused.tensor == 1 and "pairs: mlx-lm's gemma3_text" in refused.why
    # (the 4-way split refused, e.g. 2 KV heads: the pairs can still split)
    two_heads = choose(
        layer, layers, 4, 50e-6, shared_machine=False, pair_sum_s=40e-6, pairs_apart=True,
        split_refused="llama's num_key_value_heads (2) does not divide by 4",
    )  # fmt: skip
    assert (two_heads.tensor, two_heads.stages) == (2, 2)


def test_a_layers_decode_step_is_timed_on_the_model_itself(tiny_model):
    """The model's first layer, loaded alone, timed on a decode step (a figure, no more:
    what it decides is the rule's, above)."""
    assert 0 < decode_step_seconds(tiny_model("llama", 2)) < 1
