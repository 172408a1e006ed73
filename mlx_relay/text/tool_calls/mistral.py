"""Mistral's tool calls, after ``[TOOL_CALLS]`` and running to the end of the output (the
format has no end marker), in two spellings, read by mlx-lm's ``mistral`` parser:

- ``mistral_json``: ``[TOOL_CALLS][{"name": N, "arguments": {...}}, ...]``;
- ``mistral_args``: ``[TOOL_CALLS]N[ARGS]{...}``, repeatable, which newer templates
  write (their chat template holds ``[ARGS]``).

A call cut short keeps the model's own text of its arguments object.
"""

from __future__ import annotations

import re

from mlx_relay.text.tool_calls.base import JsonArguments, ToolSyntax
from mlx_relay.text.tool_calls.rules import Spell, Tool, arguments, lark, one_of
from mlx_relay.text.tool_calls.shapes import JSON_CALL_CUT, json_calls


def _json_list(one: str, spell: Spell) -> str:
    return f'"[" WS? {one} (WS? "," WS? {one})* WS? "]"'


def _args_calls(tools: list[Tool], rules: list[str], spell: Spell) -> str:
    """`N[ARGS]{...}`."""
    return one_of(
        "args_call",
        tools,
        rules,
        lambda t: f"{lark(t.name)} {spell('[ARGS]')} {arguments(t, rules)}",
    )


def _args_repeated(one: str, spell: Spell) -> str:
    return f"{one} (WS? {spell('[TOOL_CALLS]')}? WS? {one})*"


SYNTAXES = (
    ToolSyntax(
        "mistral_json",
        json_calls,
        block=_json_list,
        declared_by=("mistral",),
        partial=JSON_CALL_CUT,
    ),
    ToolSyntax(
        "mistral_args",
        _args_calls,
        block=_args_repeated,
        declared_by=("mistral",),
        template_mark="[ARGS]",
        partial=JsonArguments(
            re.compile(r"(?:^|\[TOOL_CALLS\])\s*([^\[\s]+)\s*\[ARGS\]"), re.compile(r"\[ARGS\]")
        ),
    ),
)
