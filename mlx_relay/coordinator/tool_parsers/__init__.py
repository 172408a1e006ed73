"""Our own tool-call parsers, for models mlx-lm has none for.

One module per format, each with mlx-lm's contract (`mlx_lm/tool_parsers/*.py`):
``tool_call_start``, ``tool_call_end`` and ``parse_tool_call(text, tools)``, which
returns ``{"name", "arguments"}`` or a list of them and raises on bad input. `ChatMarkup`
(coordinator/markup.py) picks the formats a model uses when its tokenizer is loaded.
"""

from __future__ import annotations

from mlx_relay.coordinator.tool_parsers import hermes, qwen_xml, tool_code


def parse_tagged(text: str, tools: list[dict] | None = None) -> list[dict]:
    """Inside ``<tool_call>`` what follows decides: ``{`` is hermes, ``<function=`` Qwen XML."""
    head = text.lstrip()
    if head.startswith("<function="):
        return qwen_xml.parse_tool_call(text, tools)
    if head.startswith(("{", "[")):
        return hermes.parse_tool_call(text, tools)
    raise ValueError("unknown <tool_call> format")


# (start marker, end marker, parser) of the formats recognised without mlx-lm's help.
FALLBACK = (
    (hermes.tool_call_start, hermes.tool_call_end, parse_tagged),
    (tool_code.tool_call_start, tool_code.tool_call_end, tool_code.parse_tool_call),
)
