"""Hermes / JSON tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(Qwen 2.5/3, Hermes, and the tool fallback's prompt, which teaches it to any model).

The parser has mlx-lm's contract: the text between the markers and the request's tools
in, ``{"name", "arguments"}`` (here always a list of them) out; bad input raises. The
grammar is the shared JSON call (shapes.json_calls); a call cut short keeps the model's
own text of its arguments object.
"""

from __future__ import annotations

import json

from mlx_relay.text.tool_calls.base import ToolSyntax
from mlx_relay.text.tool_calls.common import name_and_arguments
from mlx_relay.text.tool_calls.shapes import JSON_CALL_CUT, json_calls

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


SYNTAXES = (
    ToolSyntax(
        "hermes",
        json_calls,
        declared_by=("json_tools",),
        partial=JSON_CALL_CUT,
    ),
)

# --- the tool fallback's prompt (tool_prompt.py) ----------------------------------------

INSTRUCTIONS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def call_text(name: str, arguments: object) -> str:
    """An earlier call written back into a prompt, as the instructions ask for it."""
    body = {"name": name, "arguments": arguments}
    return f"{tool_call_start}\n{json.dumps(body, ensure_ascii=False)}\n{tool_call_end}"
