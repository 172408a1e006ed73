"""LFM2's pythonic tool calls: ``<|tool_call_start|>[N(key=value), ...]<|tool_call_end|>``,
read by mlx-lm's ``pythonic`` parser.

The grammar writes keyword arguments whose values are JSON literals, as Gemma's
tool_code does; a cut call is cut at a ``(`` or ``,`` and closed with ``)]``.
"""

from __future__ import annotations

from mlx_relay.text.tool_calls.base import Cuts, ToolSyntax
from mlx_relay.text.tool_calls.rules import Spell
from mlx_relay.text.tool_calls.shapes import keyword_calls


def _list(one: str, spell: Spell) -> str:
    return f'"[" {one} ("," WS? {one})* "]"'


SYNTAXES = (
    ToolSyntax(
        "pythonic",
        keyword_calls,
        block=_list,
        declared_by=("pythonic",),
        partial=Cuts(("(", ","), ")]"),
    ),
)
