"""Qwen XML tool calls (Qwen3-Coder):
``<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>``.

Values are written as text; each is converted by the JSON-schema type the request's
tool declares for it. mlx-lm's parser contract (see hermes.py). Our parser reads the
fallback's ``<tool_call>`` blocks that hold XML; a tokenizer that declares mlx-lm's
``qwen3_coder`` parser keeps that one. The grammar holds strings as raw text and every
other value as JSON text; a cut call is cut after a ``>`` and closed.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Callable
from typing import Any

from mlx_relay.text.tool_calls.base import Cuts, ToolSyntax
from mlx_relay.text.tool_calls.common import literal, properties, tool_schemas
from mlx_relay.text.tool_calls.rules import RawText, Spell, Tool, guided, lark, one_of, raw_string

tool_call_start = "<tool_call>"
tool_call_end = "</tool_call>"

_FUNCTION_RE = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _as_integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        value = float(text)
        if not value.is_integer():
            raise
        return int(value)


def _as_number(text: str) -> int | float:
    value = json.loads(text)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"not a number: {text!r}")
    return value


def _as_boolean(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise ValueError(f"not a boolean: {text!r}")
    return text.lower() == "true"


def _as_container(kind: type) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            value = json.loads(text)
        except ValueError:
            # Models sometimes write Python literals ({'a': 1}, True).
            value = literal(ast.parse(text, mode="eval").body)
        if not isinstance(value, kind):
            raise ValueError(f"not a {kind.__name__}: {text!r}")
        return value

    return convert


def _as_null(text: str) -> None:
    if text != "null":
        raise ValueError(f"not null: {text!r}")


_CONVERTERS: dict[str, Callable[[str], Any]] = {
    "integer": _as_integer,
    "number": _as_number,
    "boolean": _as_boolean,
    "object": _as_container(dict),
    "array": _as_container(list),
    "null": _as_null,
}


def _typed_value(raw: str, schema: Any) -> Any:
    """Convert an XML parameter by its JSON-schema type; strings stay as written.

    Values that do not fit their declared type are kept as strings: the tool
    validates its own input, and a wrong type is not malformed markup.
    """
    types = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(types, str):
        types = [types]
    if not types:
        # Without a declared type only an object or array is unambiguous.
        try:
            value = json.loads(raw)
        except ValueError:
            return raw
        return value if isinstance(value, dict | list) else raw
    text = raw.strip()
    for kind in types:
        convert = _CONVERTERS.get(str(kind).lower())
        if convert is None:
            continue
        try:
            return convert(text)
        except (ValueError, SyntaxError, RecursionError):
            continue
    return raw


def _strip_one_newline(value: str) -> str:
    """Qwen writes each parameter value on its own line; those two newlines are markup."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def parse_tool_call(text: str, tools: list[dict] | None = None) -> list[dict]:
    """``<function=NAME><parameter=P>value</parameter></function>``, one or more."""
    schemas = tool_schemas(tools)
    calls = []
    for match in _FUNCTION_RE.finditer(text):
        name = match.group(1).strip()
        props = properties(schemas.get(name))
        args = {}
        for param in _PARAMETER_RE.finditer(match.group(2)):
            key = param.group(1).strip()
            args[key] = _typed_value(_strip_one_newline(param.group(2)), props.get(key))
        if _PARAMETER_RE.sub("", match.group(2)).strip():
            raise ValueError(f"unexpected text in function {name!r}")
        calls.append({"name": name, "arguments": args})
    if not calls or _FUNCTION_RE.sub("", text).strip():
        raise ValueError("not a sequence of <function=...> blocks")
    return calls


def _xml_calls(tools: list[Tool], rules: list[str], spell: Spell) -> str:
    """`<function=N>` then `<parameter=P>value</parameter>` per argument, `</function>`.

    A value is written on its own line; strings are raw text (never holding the closing
    tags the parser looks for), every other type the JSON text the parser converts."""

    def call(t: Tool) -> str:
        params = []
        for j, (key, schema, required) in enumerate(t.properties):
            value = f"value_{t.index}_{j}"
            closed = raw_string(
                t,
                key,
                schema,
                rules,
                value,
                RawText("</parameter>", ("</function>",), newlines=True),
                spell,
            )
            if closed is None:  # numbers, booleans, null, objects and arrays: JSON text
                json_value = f"%json {json.dumps(guided(t, schema))}"
                closed = f'"\\n"? {json_value} "\\n"? "</parameter>"'
            rules.append(f"{value}: {closed}")
            param = f"{lark(f'<parameter={key}>')} {value} WS?"
            params.append(param if required else f"({param})?")
        return f'{lark(f"<function={t.name}>")} WS? {" ".join(params)} "</function>"'

    return one_of("xml_call", tools, rules, call)


SYNTAXES = (
    ToolSyntax(
        "qwen_xml",
        _xml_calls,
        # mlx-lm's Qwen3-Coder parser wants </function> last, but for one newline.
        end_gap='"\\n"?',
        declared_by=("qwen3_coder",),
        partial=Cuts((">",), "</function>"),
    ),
)
