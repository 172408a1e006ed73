"""Stop strings: nothing of a stop string is ever sent, however the text is split."""

from __future__ import annotations

import itertools

from mlx_relay.coordinator.textstream import StopStrings


def _run(stops, pieces):
    s = StopStrings(stops)
    sent = [s.feed(p) for p in pieces]
    if not s.stopped:
        sent.append(s.flush())
    return "".join(sent), s.stopped, sent


def test_stop_split_across_every_boundary():
    text = "Hello world, the END is near"
    for i, j in itertools.combinations(range(1, len(text)), 2):
        out, stopped, sent = _run(["END"], [text[:i], text[i:j], text[j:]])
        assert stopped and out == "Hello world, the "
        assert all("E" not in piece or "END" not in out for piece in sent)


def test_only_a_possible_prefix_is_held_back():
    s = StopStrings(["</stop>"])
    assert s.feed("abc </s") == "abc "
    assert s.feed("x") == "</sx"
    assert not s.stopped


def test_earliest_stop_wins_and_text_without_stops_passes_through():
    out, stopped, _ = _run(["cd", "b"], ["abcd"])
    assert stopped and out == "a"
    out, stopped, _ = _run([], ["abc", "def"])
    assert not stopped and out == "abcdef"
    out, stopped, _ = _run(["xyz"], ["abc", "xy"])
    assert not stopped and out == "abcxy"
