"""MiniCPM5's tool calls, read by mlx-lm's ``minicpm5`` parser: ``"N"><param name="k">v
</param>`` after ``<function name=``, strings raw text (stripped, never the word null),
other values JSON text (shapes.tagged). A cut call is cut after a ``>``.
"""

from __future__ import annotations

from mlx_relay.text.tool_calls.base import Cuts, ToolSyntax
from mlx_relay.text.tool_calls.shapes import tagged

SYNTAXES = (
    ToolSyntax(
        "minicpm5",
        tagged("", "", "<param name=", "</param>", raw=True),
        declared_by=("minicpm5",),
        partial=Cuts((">",), ""),
    ),
)
