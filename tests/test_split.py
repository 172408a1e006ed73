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


def test_the_default_split_follows_measured_speed(tmp_path):
    """A rank measured twice as fast does about twice the work (issue 37: a mixed
    cluster splits by speed); equally fast ranks keep the balanced split."""
    from tiny_models import make_tiny_model

    from mlx_relay.model.sharding import read_config
    from mlx_relay.model.speed import speed_weights
    from mlx_relay.model.split import default_split

    model = make_tiny_model(tmp_path / "m", "llama", num_layers=12)
    head = head_cost_in_layers(read_config(model))
    balanced = default_split(model, 12, 3)
    assert balanced == parse_layers("balanced", 12, 3, head)
    assert speed_weights([800.0, 1000.0, 1250.0]) is None  # within 1.6x: equally fast
    assert speed_weights([1000.0, 0.0, 1000.0]) is None  # a figure missing
    slow_last = default_split(model, 12, 3, speed_weights([1000.0, 1000.0, 250.0]))
    assert sum(slow_last) == 12 and slow_last[2] < balanced[2]
    assert slow_last[2] <= 2 < slow_last[1]
    fast_first = default_split(model, 12, 2, speed_weights([3000.0, 1000.0]))
    assert fast_first[0] > parse_layers("balanced", 12, 2, head)[0]


def test_a_split_that_does_not_fit_a_rank_is_named(tmp_path):
    """The speed split's memory check counts what the load's own check counts."""
    from tiny_models import make_tiny_model

    from mlx_relay.model.memory import shard_need, short_rank

    model = make_tiny_model(tmp_path / "m", "llama", num_layers=4)
    first, rest = shard_need(model, 0, 2, ends=True), shard_need(model, 2, 4)
    assert short_rank(model, [(0, 2), (2, 4)], [first, rest]) is None
    assert short_rank(model, [(0, 2), (2, 4)], [first - 1, rest]) == 0
    assert short_rank(model, [(0, 2), (2, 4)], [first, rest - 1]) == 1
    assert short_rank(model, [(0, 2), (2, 4)], [None, None]) is None  # not known: not refused


def test_the_speed_probe_measures_a_positive_rate():
    from mlx_relay.model.speed import probe

    assert probe(runs=1, run_s=0.01) > 0
