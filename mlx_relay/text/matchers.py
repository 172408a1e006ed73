"""The two things the engine asks of a sequence's text, as interfaces: all it may know.

The scheduler hands token ids in and acts on the answers; it never sees a tokenizer, a
parser or a grammar. `StopMatcher` (stream.TextStream) turns ids into text deltas and
says when a stop string ended the text; `GrammarMatcher` (constraints.Constraint,
tool_constraint.ToolCallWatch) says which ids the next step may sample and whether the
grammar is complete. A new way of reading text (another stop rule, a detokenizer on a
thread of its own) is a new implementation of one of these, not a change to the engine.
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx

from mlx_relay.text.postprocess import Delta, Final


class StopMatcher(Protocol):
    """A sequence's text: token ids in, deltas out, the stop found (engine thread)."""

    @property
    def stopped(self) -> bool: ...  # a stop string completed: feed no more

    @property
    def stop_string(self) -> str: ...

    @property
    def in_reasoning(self) -> bool: ...  # inside a think block (reasoning tokens count)

    @property
    def saw_tool_calls(self) -> bool: ...  # a "stop" is then a "tool_calls" finish

    def add(self, token: int) -> Delta: ...

    def finish(self, *, flush: bool, cut: bool) -> Final: ...


class GrammarMatcher(Protocol):
    """A request's grammar: the next step's allowed ids, and the id sampled taken."""

    @property
    def active(self) -> bool: ...  # a mask applies to the next step

    def mask(self, vocab: int) -> mx.array | None: ...

    def advance(self, token: int) -> bool: ...  # True once the grammar is complete
