"""What a tool-call format module declares: `ToolSyntax`, one per way of writing a call.

A format's module holds everything about it: its markers and parser where mlx-lm has
none (hermes, Qwen XML, Gemma's tool_code), the grammar rule of one call, how calls
follow each other, which of mlx-lm's parsers read it, and how a call cut short by
`max_tokens` is read back. The generic machinery asks the `ToolSyntax` and never names a
format: `tool_grammars.call_grammar` builds the grammar, `tool_partial.partial_calls`
reads a cut call, `ChatMarkup.of` picks the syntax of a tokenizer's declared parser.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from mlx_relay.text.tool_calls.rules import CallRule, Spell


@dataclass(frozen=True)
class Cuts:
    """A cut call read back by cutting and closing it: the separators a cut may fall
    before or after, and the text that closes a call cut there so that the format's
    parser reads it."""

    separators: tuple[str, ...]
    closer: str


@dataclass(frozen=True)
class JsonArguments:
    """A cut call whose arguments are one JSON object in the text: where the name of
    each call is (group 1), and what comes just before its arguments object."""

    name_at: re.Pattern[str]
    arguments_at: re.Pattern[str]


def one_call(one: str, spell: Spell) -> str:
    """The body of a block that holds one call."""
    return one


@dataclass(frozen=True)
class ToolSyntax:
    """One way of writing tool calls, by its name (`ChatMarkup.tool_syntax`)."""

    name: str
    call: CallRule  # the grammar rule of one call
    # The grammar of a whole block from the rule of one call (a list, a repetition).
    block: Callable[[str, Spell], str] = one_call
    # What may come between the call and its end marker, when the grammar closes it.
    end_gap: str = "WS?"
    # The modules of mlx-lm's tool parsers (mlx_lm/tool_parsers/<name>.py) that read it.
    declared_by: tuple[str, ...] = ()
    # Chosen over the other syntaxes of the same parser only when the chat template
    # holds this text ('' : the parser's usual syntax).
    template_mark: str = ""
    partial: Cuts | JsonArguments | None = None  # how a call cut short is read back
