"""Gemma 4's tool calls, read by mlx-lm's ``gemma4`` parser: ``call:N{k:<|"|>text<|"|>,
k2:1}``, strings between ``<|"|>``, other values JSON (shapes.braced). A cut call is cut
at a ``{`` or ``,`` and closed with ``}``.
"""

from __future__ import annotations

from mlx_relay.text.tool_calls.base import Cuts, ToolSyntax
from mlx_relay.text.tool_calls.shapes import braced

SYNTAXES = (
    ToolSyntax(
        "gemma4",
        braced('<|"|>', scalars_only=False),
        declared_by=("gemma4",),
        partial=Cuts(("{", ","), "}"),
    ),
)
