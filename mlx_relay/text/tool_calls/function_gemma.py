"""FunctionGemma's tool calls, read by mlx-lm's ``function_gemma`` parser:
``call:N{k:<escape>text<escape>,k2:1}``; its parser ends the call at the first ``}`` and
a value at the next comma, so only strings, numbers, booleans and null can be written (a
tool with other arguments cannot be enforced; shapes.braced). A cut call is cut at a
``{`` or ``,`` and closed with ``}``.
"""

from __future__ import annotations

from mlx_relay.text.tool_calls.base import Cuts, ToolSyntax
from mlx_relay.text.tool_calls.shapes import braced

SYNTAXES = (
    ToolSyntax(
        "function_gemma",
        braced("<escape>", scalars_only=True),
        declared_by=("function_gemma",),
        partial=Cuts(("{", ","), "}"),
    ),
)
