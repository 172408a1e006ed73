"""GLM 4.7's (and Laguna's) tool calls, read by mlx-lm's ``glm47`` parser:
``<tool_call>N<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>``, a string-typed
value raw text, any other the JSON text the parser decodes (shapes.keyed). A cut call
is cut at a newline or an argument's edge.
"""

from __future__ import annotations

from mlx_relay.text.tool_calls.base import Cuts, ToolSyntax
from mlx_relay.text.tool_calls.shapes import keyed

SYNTAXES = (
    ToolSyntax(
        "glm47",
        keyed("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
        declared_by=("glm47",),
        partial=Cuts(("\n", "<arg_key>", "</arg_value>"), ""),
    ),
)
