"""Muse Spark's tool calls, read by mlx-lm's ``muse_spark`` parser:
``<atem:invoke name="N"><atem:parameter name="k">v</atem:parameter></atem:invoke>``,
every value JSON text (the parser decodes JSON first; shapes.tagged). A cut call is cut
after a ``>``.
"""

from __future__ import annotations

from mlx_relay.text.tool_calls.base import Cuts, ToolSyntax
from mlx_relay.text.tool_calls.shapes import tagged

SYNTAXES = (
    ToolSyntax(
        "muse_spark",
        tagged(
            "<atem:invoke name=",
            "</atem:invoke>",
            "<atem:parameter name=",
            "</atem:parameter>",
            raw=False,
        ),
        declared_by=("muse_spark",),
        partial=Cuts((">",), ""),
    ),
)
