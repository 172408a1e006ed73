"""The split plan rank 0 makes before a load (model/split_plan.py), in process: what it
asks of the ranks, and only when it needs it."""

from __future__ import annotations

import pytest
from tiny_models import make_tiny_model

from mlx_relay.model.split import AUTO, default_split, layer_ranges
from mlx_relay.model.split_plan import host_speeds, plan_ranges, probes_speed

GIB = 1 << 30


class Asked:
    """A rank figure the plan may ask for, counting how often it did."""

    def __init__(self, value):
        self.value, self.calls = value, 0

    def __call__(self):
        self.calls += 1
        return self.value


def test_ranks_of_one_machine_count_as_its_fastest():
    hosts = ["a", "b", "a"]
    assert host_speeds([900.0, 400.0, 1200.0], hosts) == [1200.0, 400.0, 1200.0]
    assert host_speeds([900.0, 1200.0], ["a", "a"]) is None  # one machine: nothing to weigh
    assert probes_speed(["a", "b"]) and not probes_speed(["a", "a"])
    assert not probes_speed(["a", "b", "c"], max_ranks=2)  # (more than a header has rows)


def test_named_counts_are_taken_as_given_and_checked(tmp_path):
    model = make_tiny_model(tmp_path / "m", "llama", num_layers=6)
    stats, speeds = Asked([None, None]), Asked(None)
    assert plan_ranges(model, 2, [2, 4], stats=stats, speeds=speeds) == [(0, 2), (2, 6)]
    assert stats.calls == speeds.calls == 0  # (nothing to ask the ranks)
    for bad in ([3, 4], [6, 0], [2, 2, 2]):
        with pytest.raises(ValueError, match="does not cover 6 layers over 2 ranks"):
            plan_ranges(model, 2, bad, stats=stats, speeds=speeds)


def test_auto_splits_by_memory_without_measuring_speed(tmp_path):
    model = make_tiny_model(tmp_path / "m", "llama", num_layers=8)
    roomy, tight = {"free_memory": 30 * GIB}, {"free_memory": 10 * GIB}
    speeds = Asked([1000.0, 1000.0])
    ranges = plan_ranges(model, 2, AUTO, stats=Asked([tight, roomy]), speeds=speeds)
    first, second = (end - start for start, end in ranges)
    assert speeds.calls == 0 and first + second == 8 and first < second


def test_the_default_asks_for_speeds_once_and_splits_by_them(tmp_path):
    model = make_tiny_model(tmp_path / "m", "llama", num_layers=12)
    same = Asked(None)  # (one machine: nothing measured)
    ranges = plan_ranges(model, 3, None, stats=Asked([None] * 3), speeds=same)
    assert same.calls == 1 and ranges == layer_ranges(default_split(model, 12, 3))
    slow_last = Asked([1000.0, 1000.0, 250.0])
    ranges = plan_ranges(model, 3, None, stats=Asked([None] * 3), speeds=slow_last)
    last = ranges[2][1] - ranges[2][0]
    assert slow_last.calls == 1 and last < default_split(model, 12, 3)[2]
