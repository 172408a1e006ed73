"""Scheduling rules (coordinator/policy.py) without rank processes."""

from __future__ import annotations

from mlx_relay.coordinator.pace import step_cost
from mlx_relay.coordinator.policy import (
    CHUNK_TARGET_S,
    MIN_CHUNK,
    PROBE_CHUNK,
    STALL_STEPS,
    Policy,
    PrefillPacer,
    Scheduled,
    StepOutput,
    Unit,
    next_unit,
    pick_group,
)

# A hidden size so large that context costs nothing: a token is one unit.
WIDE = 10**9


def test_a_prompt_alone_is_probed_then_sized_to_cost_chunk_target_s():
    pacer = PrefillPacer(512, WIDE)
    assert pacer.chunk_size(decoding=False) == PROBE_CHUNK  # nothing timed yet: a probe
    pacer.prefill_chunk_took(0.032, 32, 32.0)  # 1 ms a token: a GPU
    assert pacer.chunk_size(decoding=False) == 512  # never above --prefill-chunk
    slow = PrefillPacer(512, WIDE)
    slow.prefill_chunk_took(3.2, 32, 32.0)  # 100 ms a token: a small CPU
    assert slow.chunk_size(decoding=False) == int(CHUNK_TARGET_S / 0.1)


def test_deep_in_a_long_prompt_a_chunk_is_smaller_for_its_context():
    pacer = PrefillPacer(4096, hidden=64)
    pacer.prefill_chunk_took(1.0, 100, step_cost([100], [0], 64))
    first, deep = pacer.chunk_size(False, position=0), pacer.chunk_size(False, position=3000)
    assert deep < first
    budget = CHUNK_TARGET_S / pacer.prefill_unit_s
    assert step_cost([deep], [3000], 64) <= budget < step_cost([deep + 1], [3000], 64)


def test_beside_streams_a_chunk_costs_about_stall_steps_decode_steps():
    pacer = PrefillPacer(512, WIDE)
    pacer.decode_step_took(0.02)
    assert pacer.chunk_size(decoding=True) == PROBE_CHUNK  # no prefill timed yet: probe
    pacer.prefill_chunk_took(0.032, 32, 32.0)  # 1 ms a token
    assert pacer.chunk_size(decoding=True) == STALL_STEPS * 20  # 4 x 20 ms of 1 ms tokens
    pacer.prefill_chunk_took(10.0, 10, 10.0)  # very slow tokens: never below MIN_CHUNK
    assert pacer.chunk_size(decoding=True) == MIN_CHUNK
    fast = PrefillPacer(64, WIDE)
    fast.decode_step_took(1.0)
    fast.prefill_chunk_took(0.001, 100, 100.0)
    assert fast.chunk_size(decoding=True) == 64  # never above --prefill-chunk


def test_measurements_are_moving_averages_and_tiny_chunks_are_ignored():
    pacer = PrefillPacer(512)
    pacer.decode_step_took(0.010)
    pacer.decode_step_took(0.020)
    assert abs(pacer.decode_step_s - 0.013) < 1e-9  # 0.7 x 10 ms + 0.3 x 20 ms
    pacer.prefill_chunk_took(1.0, MIN_CHUNK - 1, MIN_CHUNK - 1.0)
    assert pacer.prefill_unit_s == 0.0


def test_streams_join_the_smallest_group_with_room():
    assert pick_group([2, 1, 1], capacity=4) == 1
    assert pick_group([0, 0], capacity=4) == 0
    assert pick_group([4, 3], capacity=4) == 1
    assert pick_group([4, 4, 4], capacity=4) == 0  # all full: the first (never happens)


def test_units_take_turns():
    units = ["group 0", "group 1", "prefill"]
    assert [next_unit(units, t) for t in range(4)] == ["group 0", "group 1", "prefill", "group 0"]


# --- the engine's interface: schedule() and update_from_output() ---------------------------


def test_nothing_runnable_schedules_nothing():
    assert Policy(512).schedule([], decoding=False) is None


def test_a_prompt_goes_in_chunks_and_its_last_token_alone_for_the_logits():
    policy = Policy(64)
    policy.reset(WIDE)
    policy.update_from_output(StepOutput("prefill", 0.01, tokens=32, want_logits=False, units=32.0))
    pending, steps = 150, []
    while pending:
        plan = policy.schedule([Unit("prefill", "seq", pending)], decoding=False)
        steps.append((plan.tokens, plan.want_logits))
        pending -= plan.tokens
    assert steps == [(64, False), (64, False), (21, False), (1, True)]


def test_decode_groups_and_prompts_take_turns():
    policy = Policy(512)
    units = [Unit("group", 0), Unit("group", 1), Unit("prefill", "seq", 1000)]
    plans = [policy.schedule(units, decoding=True) for _ in range(4)]
    assert [p.unit for p in plans] == [units[0], units[1], units[2], units[0]]
    assert plans[0] == Scheduled(units[0], 1, True)  # a decode step: one token a row
    assert plans[2].tokens == PROBE_CHUNK and not plans[2].want_logits  # none timed yet


def test_what_came_back_paces_the_next_chunk_beside_streams():
    policy = Policy(512)
    policy.reset(WIDE)
    prompt = [Unit("prefill", "seq", 1000)]
    policy.update_from_output(StepOutput("group", 0.02))
    assert policy.schedule(prompt, decoding=True).tokens == PROBE_CHUNK
    done = StepOutput("prefill", 0.032, tokens=32, want_logits=False, units=32.0)
    policy.update_from_output(done)
    assert policy.schedule(prompt, decoding=True).tokens == STALL_STEPS * 20
    assert policy.schedule(prompt, decoding=False).tokens == 512  # alone: the whole chunk


def test_steps_that_say_nothing_about_the_pace_are_ignored():
    policy = Policy(512)
    policy.update_from_output(StepOutput("group", 5.0, beside_prefill=True))
    policy.update_from_output(StepOutput("prefill", 5.0, tokens=1, want_logits=True))
    assert (policy.pacer.decode_step_s, policy.pacer.prefill_unit_s) == (0.0, 0.0)


def test_with_quantized_kv_caches_a_prompt_alone_goes_in_whole_prefill_chunks():
    """Chunk boundaries change what a quantized cache holds: alone, chunks are mlx-lm's
    prefill step (--prefill-chunk), never a probe; beside streams they are still paced."""
    pacer = PrefillPacer(512, WIDE, fixed_alone=True)
    assert pacer.chunk_size(decoding=False) == 512
    pacer.decode_step_took(0.02)
    assert pacer.chunk_size(decoding=True) == PROBE_CHUNK
