"""`--tensor-parallel auto`'s rule (coordinator/layout_choice.py), on the figures it is
given: the split where its all-sums cost less than the weights it spares each rank, the
pipeline elsewhere and wherever the ranks share one machine's memory."""

from __future__ import annotations

import pytest

from mlx_relay.coordinator.layout_choice import MARGIN, choose

GB = 1e9


def test_the_70b_shape_on_two_h200s_splits_and_the_8b_shape_does_not():
    """The figures of the two shapes measured on 2 H200s (bench/RESULTS.md: the split
    1.19x on the 70B shape, 0.48x on the 8B shape): 141 and 15 GB of layers, 80 and 32
    layers, weights read at 3.5 TB/s, an all-sum of the hidden state 35 us."""
    big = choose(141 * GB, 80, 2, 35e-6, 3500 * GB, shared_machine=False)
    assert big.tensor == 2 and big.why == ""
    assert big.tensor_s < MARGIN * big.pipeline_s
    small = choose(15 * GB, 32, 2, 35e-6, 3500 * GB, shared_machine=False)
    assert small.tensor == 1 and "cost more than it saves" in small.why
    assert "pipeline" in small.describe() and "35 us" in small.describe()


def test_ranks_of_one_machine_never_split():
    shared = choose(141 * GB, 80, 2, 35e-6, 3500 * GB, shared_machine=True)
    assert shared.tensor == 1 and "share one machine" in shared.why
    assert shared.tensor_s < shared.pipeline_s  # (the figures said otherwise: still no)


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_estimates(ranks):
    choice = choose(8 * GB, 10, ranks, 1e-4, 2 * GB, shared_machine=False)
    assert choice.pipeline_s == pytest.approx(4.0)
    assert choice.tensor_s == pytest.approx(4.0 / ranks + 21 * 1e-4)
    assert choice.tensor == ranks
