"""LongCat's tool calls, read by mlx-lm's ``longcat`` parser: GLM 4.7's shape with its
own tags, ``N<longcat_arg_key>k</longcat_arg_key><longcat_arg_value>v</longcat_arg_value>``
(shapes.keyed). A cut call is cut at a newline or an argument's edge.
"""

from __future__ import annotations

from mlx_relay.text.tool_calls.base import Cuts, ToolSyntax
from mlx_relay.text.tool_calls.shapes import keyed

SYNTAXES = (
    ToolSyntax(
        "longcat",
        keyed(
            "<longcat_arg_key>",
            "</longcat_arg_key>",
            "<longcat_arg_value>",
            "</longcat_arg_value>",
        ),
        declared_by=("longcat",),
        partial=Cuts(("\n", "<longcat_arg_key>", "</longcat_arg_value>"), ""),
    ),
)
