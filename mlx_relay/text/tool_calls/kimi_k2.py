"""Kimi K2's tool calls, read by mlx-lm's ``kimi_k2`` parser:
``<|tool_call_begin|>functions.N:0<|tool_call_argument_begin|>{...}<|tool_call_end|>``,
the arguments one JSON object (a call cut short keeps the model's own text of it).
"""

from __future__ import annotations

import re

from mlx_relay.text.tool_calls.base import JsonArguments, ToolSyntax
from mlx_relay.text.tool_calls.rules import Spell, Tool, arguments, lark, one_of


def _calls(tools: list[Tool], rules: list[str], spell: Spell) -> str:
    def call(t: Tool) -> str:
        return (
            f"{spell('<|tool_call_begin|>')} {lark(f'functions.{t.name}:')} /[0-9]{{1,3}}/ "
            f"{spell('<|tool_call_argument_begin|>')} {arguments(t, rules)} "
            f"{spell('<|tool_call_end|>')}"
        )

    return one_of("k2_call", tools, rules, call)


SYNTAXES = (
    ToolSyntax(
        "kimi_k2",
        _calls,
        declared_by=("kimi_k2",),
        partial=JsonArguments(
            re.compile(r"<\|tool_call_begin\|>\s*(?:functions\.)?([^\s<>]+?):\d+"),
            re.compile(r"<\|tool_call_argument_begin\|>\s*"),
        ),
    ),
)
