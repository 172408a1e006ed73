"""Kimi K3's tool calls, read by mlx-lm's ``kimi_k3`` parser:
``<|open|>call tool="N" index="1"<|sep|>`` holding the arguments as one JSON block
(``<|open|>json type="object"<|sep|>{...}<|close|>json<|sep|>``), then
``<|close|>call<|sep|>``. A cut call is cut at a ``<|sep|>`` and closed.
"""

from __future__ import annotations

import json

from mlx_relay.text.tool_calls.base import Cuts, ToolSyntax
from mlx_relay.text.tool_calls.rules import Spell, Tool, arguments, lark, one_of


def _calls(tools: list[Tool], rules: list[str], spell: Spell) -> str:
    opened, sep, closed = spell("<|open|>"), spell("<|sep|>"), spell("<|close|>")

    def call(t: Tool) -> str:
        name = t.name.replace("&", "&amp;").replace('"', "&quot;")
        return (
            f'{opened} {lark(f"call tool={json.dumps(name)} index=")} /"[0-9]{{1,3}}"/ {sep} '
            f'WS? {opened} "json type=\\"object\\"" {sep} {arguments(t, rules)} '
            f'{closed} "json" {sep} WS? {closed} "call" {sep}'
        )

    return one_of("k3_call", tools, rules, call)


SYNTAXES = (
    ToolSyntax(
        "kimi_k3",
        _calls,
        declared_by=("kimi_k3",),
        partial=Cuts(("<|sep|>",), "<|close|>call<|sep|>"),
    ),
)
