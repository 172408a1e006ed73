"""What a tool call cut short by `max_tokens` still says: its name and its arguments so far.

OpenAI answers a call cut by the token limit with the call as far as it got (its
`arguments` the JSON text written so far, finish_reason "length"); Anthropic with a
`tool_use` block and stop_reason "max_tokens". A forced call is held to its grammar
(tool_grammars.py), so what was written is the start of a valid call: the name comes
first, then the arguments in the format's order. `partial_calls` reads it back:

- JSON formats (the arguments are a JSON object in the text): the arguments are the
  model's own text from the object's ``{`` to where it stopped;
- every other format: the arguments complete so far (the text cut just before or after
  one of the format's separators, closed by the format's end, read by its own parser),
  written as JSON without the closing ``}``: a prefix of the call's JSON arguments.

`json_prefix_object` reads such a prefix as the object it starts (Anthropic's `input`,
Ollama's `arguments` are objects), closing what is open.

Which of the two a format is, and its separators or markers, its module says
(`ToolSyntax.partial`); this module only applies them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from mlx_relay.text import tool_calls
from mlx_relay.text.tool_calls.base import Cuts, JsonArguments
from mlx_relay.text.tool_calls.common import tool_schemas

_DECODER = json.JSONDecoder()
Parse = Callable[[str, "list[dict] | None"], list[tuple[str, dict]]]


def syntax_of_body(syntax: str | None, start: str, body: str) -> str | None:
    """The syntax a block is in: inside ``<tool_call>`` the body tells hermes from Qwen XML
    (the fallback prompt writes hermes whatever the model's template does)."""
    if start == "<tool_call>" and syntax in (None, "hermes", "qwen_xml"):
        head = body.lstrip()
        if head.startswith("<function="):
            return "qwen_xml"
        if head.startswith(("{", "[")) or not head:
            return "hermes"
    return syntax


def partial_calls(
    syntax: str | None, body: str, parse: Parse, tools: list[dict] | None
) -> list[tuple[str, str, bool]]:
    """(name, arguments text, complete) of each call in a block cut short; [] where the
    name of the last call was not written yet (or the format is unknown). Earlier
    calls of the block that are whole come first, complete."""
    known = tool_calls.find(syntax)
    how = known.partial if known is not None else None
    if isinstance(how, JsonArguments):
        return _json_partial(how, body)
    if isinstance(how, Cuts):
        return _cut_partial(how, body, parse, tools)
    return []


def _json_partial(json_call: JsonArguments, body: str) -> list[tuple[str, str, bool]]:
    out = []
    for found in json_call.name_at.finditer(body):
        try:
            name = json.loads(f'"{found.group(1)}"')
        except ValueError:
            return []
        at = json_call.arguments_at.search(body, found.end())
        text = body[at.end() :].rstrip() if at else ""
        try:
            whole, _ = _DECODER.raw_decode(text)
            out.append((name, json.dumps(whole, ensure_ascii=False), True))
        except ValueError:
            out.append((name, text if text.startswith("{") else "", False))
            return out
    return out


def _cut_partial(
    cut_at: Cuts, body: str, parse: Parse, tools: list[dict] | None
) -> list[tuple[str, str, bool]]:
    separators, closer = cut_at.separators, cut_at.closer
    # Just before or after a separator, or after a tool's name; never at the very end
    # (a value there, `3` of `35`, may be cut short).
    cuts = set()
    for sep in (*separators, *tool_schemas(tools)):
        for m in re.finditer(re.escape(sep), body):
            cuts.update((m.start(), m.end()) if sep in separators else (m.end(),))
    cuts.discard(len(body))
    known = set(tool_schemas(tools))
    for cut in sorted(cuts, reverse=True):
        try:
            calls = parse(body[:cut] + closer, tools)
        except Exception:  # a parser of any origin: any error is "not here"
            continue
        if not calls or (known and calls[-1][0] not in known):  # (a name cut short)
            continue
        *whole, (name, args) = calls
        out = [(n, json.dumps(a, ensure_ascii=False), True) for n, a in whole]
        return [*out, (name, json.dumps(args, ensure_ascii=False)[:-1], False)]
    return []


def json_prefix_object(text: str) -> dict[str, Any]:
    """The object a prefix of JSON object text starts, what is open closed and a value
    cut inside a literal or a key left out ({} where nothing can be read)."""
    for candidate in _closings(text.strip()):
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        return value if isinstance(value, dict) else {}
    return {}


def _closings(text: str) -> list[str]:
    """Ways to close a JSON prefix, best first: as it is, closing an open string, then
    cut back to the last complete member."""
    closers, in_string, escaped = [], False, False
    safe = []  # (position after a complete member, closers open there)
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            closers.append("}" if ch == "{" else "]")
        elif ch in "}]" and closers:
            closers.pop()
        elif ch == ",":
            safe.append((i, list(closers)))
        if not in_string and ch in "{[":
            safe.append((i + 1, list(closers)))
    tail = "".join(reversed(closers))
    out = [text + tail]
    if in_string:
        out.append((text[:-1] if escaped else text) + '"' + tail)
    out.extend(text[:at] + "".join(reversed(open_)) for at, open_ in reversed(safe))
    return out
