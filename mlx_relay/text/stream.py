"""One sequence's text as the engine sees it: token ids in, text deltas out, a stop found.

The engine reads token ids back and hands each to its sequence's `TextStream`, the
sequence's stop matcher: it detokenizes (mlx-lm's streaming detokenizer; special tokens
show no text) and feeds the text to the output parser (postprocess.py), which splits
content, reasoning and tool calls and cuts the stop strings. The engine acts only on
what comes back: a delta to stream, and `stopped`. The grammar a sequence follows is its
other matcher (constraints.Constraint); the engine knows nothing else of text.

It runs on the engine thread, as before: bench/bench_detokenize.py measured it at tens
of microseconds a token (12-140 on a busy 2-core host), against milliseconds a decode
step, work the engine already does while the device runs the next step; and a stop
string must end its sequence before that sequence's next step launches. Moving it off
the thread would not pay.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

from mlx_relay.text.postprocess import Delta, Final, OutputParser


class TextStream:
    """A sequence's detokenizer and output parser, fed one token id at a time."""

    def __init__(self, detokenizer: Any, parser: OutputParser, special_ids: Container[int]) -> None:
        """`detokenizer`: a fresh mlx-lm streaming detokenizer (`tokenizer.detokenizer`);
        `special_ids`: tokens that add no text (they still count as generated)."""
        self.parser = parser
        self._detokenizer = detokenizer
        self._special = special_ids

    @property
    def stopped(self) -> bool:
        """A stop string completed: the sequence ends (feed no more)."""
        return self.parser.stopped

    @property
    def stop_string(self) -> str:
        return self.parser.stop_string

    @property
    def in_reasoning(self) -> bool:
        return self.parser.in_reasoning

    @property
    def saw_tool_calls(self) -> bool:
        return self.parser.saw_tool_calls

    def add(self, token: int) -> Delta:
        """The text one token read back adds (nothing for a special token)."""
        if token in self._special:
            return Delta()
        self._detokenizer.add_token(token)
        return self._feed(self._detokenizer.last_segment)

    def finish(self, *, flush: bool, cut: bool) -> Final:
        """The last delta: what the detokenizer still holds (`flush`, unless a stop string
        ended the text) and what the parser held back. `cut`: the output ended at its
        token limit, so a tool call still open comes back as far as it got."""
        first = Delta()
        if flush and not self.parser.stopped:
            self._detokenizer.finalize()
            first = self._feed(self._detokenizer.last_segment)
        final = self.parser.finish(cut=cut)
        final.content = first.content + final.content
        final.reasoning = first.reasoning + final.reasoning
        final.tool_calls = first.tool_calls + final.tool_calls
        return final

    def _feed(self, text: str) -> Delta:
        return self.parser.feed(text) if text else Delta()
