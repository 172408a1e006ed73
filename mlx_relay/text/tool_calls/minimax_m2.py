"""MiniMax M2's tool calls, read by mlx-lm's ``minimax_m2`` parser:
``<invoke name="N"><parameter name="k">v</parameter></invoke>``, strings raw text
(stripped, never the word null), other values JSON text (shapes.tagged). A cut call is
cut after a ``>`` and closed with ``</invoke>``.
"""

from __future__ import annotations

from mlx_relay.text.tool_calls.base import Cuts, ToolSyntax
from mlx_relay.text.tool_calls.shapes import tagged

SYNTAXES = (
    ToolSyntax(
        "minimax_m2",
        tagged("<invoke name=", "</invoke>", "<parameter name=", "</parameter>", raw=True),
        declared_by=("minimax_m2",),
        partial=Cuts((">",), "</invoke>"),
    ),
)
