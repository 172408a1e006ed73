"""Step cost, the measured pace and step deadlines (coordinator/pace.py), in process."""

from __future__ import annotations

from mlx_relay.coordinator.pace import (
    DECAY,
    FIRST_SHAPE_S,
    LARGE_STEP_UNITS,
    SLACK,
    StepPace,
    step_cost,
    step_shape,
    tokens_within,
)


def test_a_token_costs_more_the_more_context_it_attends_to():
    assert step_cost([1], [0], 4096) < step_cost([1], [8000], 4096)
    assert step_cost([512], [0], 4096) == 512 * (1 + 256 / (6 * 4096))
    # a decode batch: one token a row, each at its own context
    assert step_cost([1, 1], [10, 20], 64) == step_cost([1], [10], 64) + step_cost([1], [20], 64)


def test_tokens_within_is_the_largest_chunk_that_fits():
    for offset in (0, 500, 5000):
        n = tokens_within(300.0, offset, 64)
        assert step_cost([n], [offset], 64) <= 300.0 < step_cost([n + 1], [offset], 64)
    assert tokens_within(0.0, 0, 64) == 1


def test_before_any_measurement_a_step_gets_the_floor_alone():
    pace = StepPace()
    assert pace.expected(1000.0) == 0.0
    assert pace.allowance(1000.0, floor=30.0, ranks=3) == 30.0


def test_the_allowance_grows_with_the_work_and_the_ranks():
    pace = StepPace()
    pace.observe(1.0, 0.05)  # a decode step: 50 ms
    pace.observe(100.0, 1.05)  # a chunk: 1 s beyond the fixed part, 10 ms a unit
    assert abs(pace.expected(1000.0) - (0.05 + 10.0)) < 1e-9
    assert pace.allowance(1000.0, 2.0, ranks=3) == 2.0 + SLACK * 3 * pace.expected(1000.0)
    assert pace.allowance(1.0, 2.0) < pace.allowance(1000.0, 2.0)


def test_slow_steps_raise_the_estimate_at_once_fast_ones_lower_it_slowly():
    pace = StepPace()
    pace.observe(1.0, 0.1)
    pace.observe(1.0, 1.0)
    assert pace.step_s == 1.0
    pace.observe(1.0, 0.0001)
    assert abs(pace.step_s - (DECAY * 1.0 + (1 - DECAY) * 0.0001)) < 1e-12


def test_a_large_step_before_any_large_one_was_timed_is_costed_patiently():
    pace = StepPace()
    pace.observe(1.0, 0.1)  # only decode steps so far
    # each unit at the small step's rate per LARGE_STEP_UNITS / 2 units
    assert pace.expected(LARGE_STEP_UNITS * 10) >= 0.1 * 10


def test_a_step_of_a_new_shape_may_compile_its_kernels_first():
    pace = StepPace()
    assert pace.allowance(32.0, 0.5, 2, new_shape=True) == FIRST_SHAPE_S
    assert pace.allowance(32.0, 0.5, 2) == 0.5
    assert step_shape([1, 1, 1]) == (3, 1)  # a decode group of three
    assert step_shape([300]) == step_shape([512]) == (1, 512)  # chunks of one size class
    assert step_shape([32]) != step_shape([33])
