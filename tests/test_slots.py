"""Rank 0's slot bookkeeping for the prompt cache: which slot a prompt takes, what stays."""

from __future__ import annotations

from mlx_relay.coordinator.slots import MIN_SHARED, SlotTable, common_prefix_len


def take(table: SlotTable, prompt: list[int]) -> tuple[int, int, int | None]:
    t = table.take(prompt)
    return t.slot, t.cached, t.source


SYSTEM = list(range(100, 100 + 2 * MIN_SHARED))  # a shared system prompt


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([], [1]) == 0


def test_next_turn_takes_over_a_parked_slot_and_another_conversation_copies_it():
    table = SlotTable(3)
    slot, cached, source = take(table, SYSTEM + [1, 2])
    assert (cached, source) == (0, None)
    table.park(slot, SYSTEM + [1, 2, 3])
    # The next turn keeps all the parked slot holds: it takes it over.
    assert take(table, SYSTEM + [1, 2, 3, 4, 5]) == (slot, len(SYSTEM) + 3, slot)
    table.park(slot, SYSTEM + [1, 2, 3, 4, 5, 6])
    # Another conversation shares only the system prompt: a copy, and the source stays.
    other, cached, source = take(table, SYSTEM + [7, 8])
    assert other != slot and (cached, source) == (len(SYSTEM), slot)
    assert slot in table.parked and table.pinned[slot] == 1


def test_a_pinned_copy_source_is_never_taken_over_or_evicted():
    table = SlotTable(2)
    a, _, _ = take(table, SYSTEM + [1])
    table.park(a, SYSTEM + [1, 2, 3])
    b, _, source = take(table, SYSTEM + [9, 9])  # copies a into the last empty slot
    assert source == a and table.pinned[a] == 1
    assert table.open() == 0  # a is pinned, b is running: nothing may be taken
    table.park(b, SYSTEM + [9, 9, 9])
    # A prompt sharing more with pinned a than with b must not cut a back under the copy.
    slot, cached, source = take(table, SYSTEM + [1, 2])
    assert slot == b and source is None and cached == 0
    assert table.over_budget(1) == []  # the only other parked slot is pinned
    table.unpin(a)
    assert table.open() == 1


def test_the_newest_parked_slot_always_stays_and_a_pinned_best_match_is_copied():
    table = SlotTable(3)
    a = table.take(SYSTEM + [1]).slot
    table.park(a, SYSTEM + [1, 2])
    b = table.take(SYSTEM + [3, 3])
    assert b.source == a and table.pinned[a] == 1
    # The whole of pinned a is wanted: with a slot free it is copied again, not skipped.
    c = table.take(SYSTEM + [1, 2, 4])
    assert (c.source, c.cached) == (a, len(SYSTEM) + 2) and table.pinned[a] == 2
    table.park(b.slot, SYSTEM + [3, 3, 3])
    assert table.over_budget(1) == []  # a is pinned, b is the newest
    table.unpin(a)
    table.unpin(a)
    assert table.over_budget(1) == [a]


def test_a_taken_over_slot_comes_back_with_its_tokens():
    table = SlotTable(1)
    a = table.take(SYSTEM).slot
    table.park(a, SYSTEM + [1])
    t = table.take(SYSTEM + [1, 2])
    assert (t.slot, t.source, t.held) == (a, a, SYSTEM + [1]) and not table.parked


def test_short_shared_prefixes_do_not_displace_parked_caches():
    table = SlotTable(2)
    slot, _, _ = take(table, SYSTEM)
    table.park(slot, SYSTEM + [1])
    short = SYSTEM[: MIN_SHARED - 1]
    other, cached, source = take(table, short + [5, 6, 7])
    assert other != slot and (cached, source) == (0, None)
    assert table.parked[slot] == SYSTEM + [1] and not table.pinned
    # A short prompt identical to a parked one is still found whole.
    table.park(other, [5, 6, 7])
    assert take(table, [5, 6, 7]) == (other, 2, other)


def test_budget_forget_and_reset():
    table = SlotTable(4)
    for i in range(3):
        slot, _, _ = take(table, [i] * 40)
        table.park(slot, [i] * 40)
    assert table.stats() == (3, 120)
    assert table.over_budget(80) == [0]  # oldest first, down to the budget
    assert table.forget([1, 3]) == [1]
    assert table.stats() == (1, 40)
    for slot in (0, 1):  # the engine frees them on every rank, then releases them
        table.release(slot)
    table.reset()
    assert table.stats() == (0, 0) and sorted(table.free) == [0, 1, 2, 3]


def test_salts_keep_parked_caches_apart():
    """A prompt is served only by parked caches of its own cache salt; a taken-over slot
    given back unused is parked again under the salt it had."""
    table = SlotTable(2)
    a = table.take(SYSTEM, "t1").slot
    table.park(a, SYSTEM + [1], "t1")
    other = table.take(SYSTEM + [1, 2], "t2")
    assert other.slot != a and (other.cached, other.source) == (0, None)
    same = table.take(SYSTEM + [1, 2], "t1")
    assert (same.slot, same.source, same.cached, same.salt) == (a, a, len(SYSTEM) + 1, "t1")
    table.park(same.slot, same.held, same.salt)  # (what SlotSteps.give_back does)
    assert table.take(SYSTEM + [1, 2], "t1").cached == len(SYSTEM) + 1
    table.park(a, SYSTEM + [1], "t1")
    evicting = table.take(SYSTEM + [1, 2], "t2")
    assert (evicting.slot, evicting.cached, evicting.source) == (a, 0, None)
