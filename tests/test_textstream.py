"""The one hold-back: nothing of a stop string or a marker is ever sent, however the text
is split, and only a tail that may still become one is held back."""

from __future__ import annotations

import itertools

from mlx_relay.text.postprocess import OutputParser
from mlx_relay.text.textstream import first_match, held_back


def _run(stops, pieces, **kwargs):
    parser = OutputParser(stop=stops, **kwargs)
    sent = [parser.feed(p).content for p in pieces]
    stopped = parser.stopped
    sent.append(parser.finish().content)
    return "".join(sent), stopped, sent


def test_held_back_is_the_longest_tail_that_may_become_a_pattern():
    assert held_back("abc </s", ["</stop>", "<think>"]) == 3
    assert held_back("abc <", ["</stop>", "<think>"]) == 1
    assert held_back("abc </stop>", ["</stop>"]) == 0  # complete: found, not held
    assert held_back("abc", []) == 0
    assert first_match("a <b> <a>", ["<a>", "<b>"]) == (2, "<b>")
    assert first_match("xx ab", ["ab", "abc"], start=3) == (3, "ab")
    assert first_match("abc", ["abc", "ab"]) == (0, "abc")  # the longest on a tie
    assert first_match("ab", ["ab"], start=1) is None


def test_stop_split_across_every_boundary():
    text = "Hello world, the END is near"
    for i, j in itertools.combinations(range(1, len(text)), 2):
        out, stopped, sent = _run(["END"], [text[:i], text[i:j], text[j:]])
        assert stopped and out == "Hello world, the "
        assert not any("E" in piece for piece in sent)


def test_only_a_possible_prefix_is_held_back():
    parser = OutputParser(stop=["</stop>"])
    assert parser.feed("abc </s").content == "abc"  # the space waits for what follows it
    assert parser.feed("x").content == " </sx"
    assert not parser.stopped


def test_earliest_stop_wins_and_text_without_stops_passes_through():
    out, stopped, _ = _run(["cd", "b"], ["abcd"])
    assert stopped and out == "a"
    out, stopped, _ = _run([], ["abc", "def"])
    assert not stopped and out == "abcdef"
    out, stopped, _ = _run(["xyz"], ["abc", "xy"])
    assert not stopped and out == "abcxy"


def test_nothing_is_fed_after_a_stop():
    parser = OutputParser(stop=["END"])
    assert parser.feed("a END b").content == "a"
    assert parser.stopped and parser.feed("more").content == ""
    assert parser.finish().content == " "  # whitespace before the stop stays content


def test_a_stop_string_that_starts_like_a_marker_is_held_for_both():
    # "<tool" may become <tool_call> or the stop string: neither is sent early.
    parser = OutputParser(stop=["<tools>"])
    assert parser.feed("see <tool").content == "see"
    delta = parser.feed("s> after")
    assert (delta.content, parser.stopped) == ("", True)
    assert parser.finish().content == " "


def test_a_stop_string_inside_reasoning_or_a_tool_call_ends_the_stream():
    out, stopped, _ = _run(["STOP"], ["<think>plan STO", "P more</think>answer"])
    assert stopped and out == ""
    parser = OutputParser(stop=["Paris"])
    parser.feed('<tool_call>{"name": "get_weather", "arguments": {"city": "Par')
    parser.feed('is"}}</tool_call>')
    final = parser.finish()
    assert parser.stopped and parser.tool_calls == []
    assert final.malformed_tool_call  # the call was cut: shown as written, flagged
    assert parser.content == '<tool_call>{"name": "get_weather", "arguments": {"city": "'


def test_a_stop_string_after_a_marker_leaves_the_parsed_part():
    text = "<think>why</think>Answer: 42.\nEND trailing"
    for i in range(len(text) + 1):
        parser = OutputParser(stop=["END"])
        parser.feed(text[:i])
        parser.feed(text[i:])
        parser.finish()
        assert (parser.reasoning, parser.content, parser.stopped) == ("why", "Answer: 42.\n", True)
