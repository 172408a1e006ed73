"""Hermes / JSON tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

mlx-lm's parser contract: the text between the markers and the request's tools in,
``{"name", "arguments"}`` (here always a list of them) out; bad input raises.
"""

from __future__ import annotations

import json

from mlx_relay.coordinator.tool_parsers.common import name_and_arguments

tool_call_start = "<tool_call>"
tool_call_end = "</tool_call>"


def parse_tool_call(text: str, tools: list[dict] | None = None) -> list[dict]:
    """One object, several in a row, or a list; string arguments are decoded once."""
    decoder = json.JSONDecoder()
    text = text.strip()
    calls = []
    pos = 0
    while pos < len(text):
        obj, pos = decoder.raw_decode(text, pos)
        for item in obj if isinstance(obj, list) else [obj]:
            name, args = name_and_arguments(item)
            calls.append({"name": name, "arguments": args})
        while pos < len(text) and (text[pos].isspace() or text[pos] == ","):
            pos += 1
    if not calls:
        raise ValueError("empty tool call")
    return calls
