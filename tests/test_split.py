"""The layer split over ranks (model.split): even, weighted, balanced, and `--layers`."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_relay.model.sharding import head_cost_in_layers
from mlx_relay.model.split import (
    AUTO,
    balanced_split,
    layer_ranges,
    model_layers,
    parse_layers,
    resolve_layers,
    split_layers,
)


def test_split_layers_even():
    assert split_layers(30, 4) == [8, 8, 7, 7]
    assert split_layers(30, 3) == [10, 10, 10]
    assert split_layers(3, 3) == [1, 1, 1]
    with pytest.raises(ValueError):
        split_layers(2, 3)


def test_split_layers_weighted():
    assert split_layers(30, 3, [1, 1, 1]) == split_layers(30, 3)
    assert split_layers(30, 2, [2, 1]) == [20, 10]
    assert split_layers(30, 3, [1, 1, 28]) == [1, 1, 28]
    assert split_layers(10, 3, [0, 0, 1]) == [1, 1, 8]  # every rank keeps a layer
    assert split_layers(30, 3, [16e9, 8e9, 8e9]) == [15, 8, 7]
    with pytest.raises(ValueError):
        split_layers(30, 3, [1, 1])
    with pytest.raises(ValueError):
        split_layers(30, 2, [0, 0])
    with pytest.raises(ValueError):
        split_layers(30, 2, [1, float("nan")])


@settings(deadline=None)
@given(
    st.integers(1, 48).flatmap(
        lambda n: st.tuples(
            st.integers(n, 160),
            st.just(n),
            st.one_of(st.none(), st.lists(st.floats(0, 1e12), min_size=n, max_size=n)),
        )
    )
)
def test_split_layers_properties(args):
    num_layers, n, weights = args
    if weights is not None and not any(w > 0 for w in weights):
        weights = None
    counts = split_layers(num_layers, n, weights)
    assert len(counts) == n and sum(counts) == num_layers and min(counts) >= 1
    if weights is None:
        assert max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True)
        return
    quota = [Fraction(num_layers) * Fraction(w) / sum(map(Fraction, weights)) for w in weights]
    for i in range(n):
        # More weight never means fewer layers, and nobody gets more than their share
        # rounded up unless it is the minimum of one layer.
        assert counts[i] == 1 or counts[i] <= math.ceil(quota[i])
        for j in range(n):
            if weights[i] > weights[j]:
                assert counts[i] >= counts[j]
    if all(q >= 1 for q in quota):  # nobody lifted to the minimum: plain largest remainder
        assert all(abs(c - q) < 1 for c, q in zip(counts, quota, strict=True))


def test_parse_layers_and_ranges():
    assert parse_layers("10,12,8", 30, 3) == [10, 12, 8]
    assert parse_layers(" 10, 12 ,8 ", 30, 3) == [10, 12, 8]
    for spec, words in [
        ("10,12", "2 counts for 3 ranks"),
        ("10,x,8", "comma-separated"),
        ("10,0,20", "at least 1"),
        ("10,12,9", "sums to 31"),
    ]:
        with pytest.raises(ValueError, match=words):
            parse_layers(spec, 30, 3)
    assert layer_ranges([10, 12, 8]) == [(0, 10), (10, 22), (22, 30)]
    assert layer_ranges([]) == []


SMOLLM2_135M = {  # the default model's config.json, the fields that size its matmuls
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "num_hidden_layers": 30,
}


def test_balanced_split_counts_rank_0s_lm_head():
    head = head_cost_in_layers(SMOLLM2_135M)
    assert head == pytest.approx(8.0, abs=0.01)  # 49152 x 576 against 3.54 M per layer
    assert parse_layers("balanced", 30, 2, head) == [11, 19]
    assert balanced_split(30, 3, head) in ([4, 13, 13], [5, 13, 12], [5, 12, 13])  # 12.67 each
    assert balanced_split(30, 3, 0.0) == [10, 10, 10]  # no head cost: the even split
    assert balanced_split(4, 2, 100.0) == [1, 3]  # a head bigger than a share: 1 layer
    assert balanced_split(30, 1, head) == [30]
    moe = {**SMOLLM2_135M, "num_experts_per_tok": 2, "moe_intermediate_size": 768}
    assert head_cost_in_layers(moe) == pytest.approx(head)  # two experts of half the size
    assert head_cost_in_layers({"hidden_size": 576}) == 0.0  # unknown: no adjustment


def test_resolve_layers_is_the_one_reading_of_layers():
    assert resolve_layers("", 30, 3) is None  # the default split, left to the pipeline
    assert resolve_layers("  ", 30, 3) is None
    assert resolve_layers(" auto ", 30, 3) == AUTO
    assert resolve_layers("even", 30, 4) == [8, 8, 7, 7]
    assert resolve_layers("10,12,8", 30, 3) == [10, 12, 8]
    with pytest.raises(ValueError, match="sums to 31"):
        resolve_layers("10,12,9", 30, 3)
    # No model is read when the spec does not need its layer count.
    assert model_layers("", "/nowhere", 2) is None
    assert model_layers("auto", "/nowhere", 2) == AUTO
