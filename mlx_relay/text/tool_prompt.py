"""Tools for a model whose chat template has no place for them (the tool fallback).

Many small chat models (the embedded default, SmolLM2, among them) have templates that
ignore `tools`: rendered with or without them, the prompt is the same, so the model would
never learn of them. Rather than refuse such a request, rank 0 writes the tools into the
system prompt the way Hermes and Qwen 2.5 templates do (and LM Studio does for such
models), and the model is asked to answer a call as

    <tool_call>
    {"name": "<function name>", "arguments": <arguments as a JSON object>}
    </tool_call>

which the output parser already reads (`tool_calls.hermes`, which also holds these
instructions). Earlier turns are
rewritten the same way: an assistant's tool calls become that markup in its content and a
tool's result a user turn in `<tool_response>` tags, since such templates know no `tool`
role or `tool_calls`. A forced `tool_choice` opens the `<tool_call>` block in the prompt;
forced or not, a call is held to a grammar (`tool_grammars.call_grammar`, hermes), so even
a small model writes a well-formed call. `--no-tool-fallback` turns this off: such requests are
refused instead, as before.
"""

from __future__ import annotations

import json
from typing import Any

from mlx_relay.text.tool_calls import hermes


def system_text(tools: list[dict]) -> str:
    """The tools and how to call them, as a system prompt section."""
    listed = "\n".join(json.dumps(_as_function(t), ensure_ascii=False) for t in tools)
    return hermes.INSTRUCTIONS.format(tools=listed)


def with_tools(messages: list[dict[str, Any]], tools: list[dict]) -> list[dict[str, Any]]:
    """`messages` (chat template dicts) with the tools in the system prompt and earlier
    calls and results written as the model is told to write and read them."""
    section = system_text(tools)
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m["role"]
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in m["tool_calls"])
            content = _text(m.get("content"))
            out.append({"role": "assistant", "content": f"{content}\n{calls}".strip()})
        elif role == "tool":
            response = f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"
            prev = out[-1] if out else None
            if prev is not None and prev.get("_tool_responses"):
                prev["content"] += "\n" + response  # consecutive results: one user turn
            else:
                out.append({"role": "user", "content": response, "_tool_responses": True})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("_tool_responses", None)
    if out and out[0]["role"] == "system" and isinstance(out[0].get("content"), str):
        out[0]["content"] = f"{out[0]['content']}\n\n{section}".lstrip()
    else:
        out.insert(0, {"role": "system", "content": section})
    return out


def _as_function(tool: dict) -> dict:
    """OpenAI's `{"type": "function", "function": {...}}` whatever shape came in."""
    if isinstance(tool.get("function"), dict):
        return {"type": "function", "function": tool["function"]}
    return {"type": "function", "function": tool}


def _call_text(call: dict) -> str:
    function = call.get("function") or {}
    return hermes.call_text(function.get("name", ""), function.get("arguments") or {})


def _text(content: Any) -> str:
    """A message's content as text (parts lists keep their text parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)
