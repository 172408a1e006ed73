"""Call shapes several formats share, each the grammar rule of one call given the
markers its format spells it with.

- `json_calls`: ``{"name": N, "arguments": {...}}`` (hermes, Mistral's JSON list);
- `keyword_calls`: ``N(key=value, ...)``, values as JSON literals (Gemma's tool_code,
  LFM2's pythonic);
- `keyed`: ``N<key>k</key><value>v</value>`` (GLM 4.7, LongCat); a string-typed value
  is raw text (the parser strips it, so it neither begins nor ends in whitespace), any
  other the JSON text the parser decodes;
- `tagged`: ``<invoke name="N"><parameter name="k">v</parameter></invoke>`` and the like
  (MiniMax M2, MiniCPM5, Muse Spark);
- `braced`: ``call:N{k:v,...}``, strings between a quote marker (Gemma 4, FunctionGemma).

Each shape follows what the formats' parsers do with the text (tests/test_tool_constraint.py
walks every grammar and parses the result with mlx-lm's parser): the name of an allowed
tool, then its arguments in the order of the schema's ``properties``, the required ones
always there.
"""

from __future__ import annotations

import json
import re
from typing import Any

from mlx_relay.errors import InvalidRequest
from mlx_relay.text.tool_calls.base import JsonArguments
from mlx_relay.text.tool_calls.rules import (
    ARGUMENTS,
    NAME,
    CallRule,
    RawText,
    Spell,
    Tool,
    arguments,
    closed_value,
    comma_list,
    guided,
    json_value,
    lark,
    one_of,
    raw_string,
)


def json_calls(tools: list[Tool], rules: list[str], spell: Spell) -> str:
    """`{"name": N, "arguments": A}`, whitespace as JSON allows (bounded)."""

    def call(t: Tool) -> str:
        args = f'WS? "," WS? {lark(ARGUMENTS)} WS? ":" WS? {arguments(t, rules)}'
        if t.takes_no_arguments:  # the parsers read a call without them as {}
            args = f"({args})?"
        name = lark(json.dumps(t.name, ensure_ascii=False))
        return f'"{{" WS? {lark(NAME)} WS? ":" WS? {name} {args} WS? "}}"'

    return one_of("json_call", tools, rules, call)


# A JSON call cut short: its name, and what comes just before its arguments object.
JSON_CALL_CUT = JsonArguments(
    re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"'),
    re.compile(r'"(?:arguments|parameters)"\s*:\s*'),
)


def keyword_calls(tools: list[Tool], rules: list[str], spell: Spell) -> str:
    """`N(key=value, ...)`, keyword arguments only, values as JSON literals."""

    def call(t: Tool) -> str:
        items = []
        for j, (key, schema, required) in enumerate(t.properties):
            value = f"kw_{t.index}_{j}"
            rules.append(f"{value}: %json {json.dumps(guided(t, schema))}")
            items.append((f'"{key}=" {value}', required))
        return f'{lark(t.name + "(")} {comma_list(items)} ")"'

    return one_of("py_call", tools, rules, call)


def keyed(key_open: str, key_close: str, value_open: str, value_close: str) -> CallRule:
    """GLM 4.7's and LongCat's `N<arg_key>k</arg_key><arg_value>v</arg_value>`."""

    def calls(tools: list[Tool], rules: list[str], spell: Spell) -> str:
        def call(t: Tool) -> str:
            params = []
            for j, (key, schema, required) in enumerate(t.properties):
                value = f"kv_{t.index}_{j}"
                typed = isinstance(schema, dict) and schema.get("type") == "string"
                raw = RawText(value_close, trimmed=True) if typed else None
                closed_value(t, key, schema, rules, value, spell, value_close, raw)
                params.append(
                    (
                        f"{spell(key_open)} {lark(key)} {spell(key_close)} WS? "
                        f"{spell(value_open)} {value}",
                        required,
                    )
                )
            return f"{lark(t.name)} WS? {comma_list(params, 'WS?')}"

        return one_of("keyed_call", tools, rules, call)

    return calls


def tagged(invoke: str, invoke_end: str, param: str, param_end: str, *, raw: bool) -> CallRule:
    """MiniMax M2's, MiniCPM5's and Muse Spark's XML: `invoke` is what precedes the quoted
    name, `param` what precedes a quoted argument name. `raw`: strings are raw text
    (stripped, never the word null), else every value JSON text."""

    def calls(tools: list[Tool], rules: list[str], spell: Spell) -> str:
        def call(t: Tool) -> str:
            params = []
            for j, (key, schema, required) in enumerate(t.properties):
                value = f"tag_{t.index}_{j}"
                avoid = (invoke_end,) if invoke_end else ()
                text = RawText(param_end, avoid, trimmed=True, not_null=True) if raw else None
                closed_value(t, key, schema, rules, value, spell, param_end, text)
                tag = lark(f"{param}{json.dumps(key)}>")
                params.append((f"{tag} {value}", required))
            head = lark(f"{invoke}{json.dumps(t.name)}>")
            end = f" WS? {lark(invoke_end)}" if invoke_end else ""
            return f"{head} WS? {comma_list(params, 'WS?')}{end}"

        return one_of("tag_call", tools, rules, call)

    return calls


def braced(quote: str, *, scalars_only: bool) -> CallRule:
    """Gemma 4's and FunctionGemma's `call:N{k:v,...}`, strings between `quote`.
    `scalars_only`: the parser ends the call at the first ``}`` and a value at the next
    comma, so only strings, numbers, booleans and null can be written (a tool with other
    arguments cannot be enforced)."""

    def calls(tools: list[Tool], rules: list[str], spell: Spell) -> str:
        q = spell(quote)

        def call(t: Tool) -> str:
            params = []
            for j, (key, schema, required) in enumerate(t.properties):
                value = f"br_{t.index}_{j}"
                avoid = ("}",) if scalars_only else ()
                closed = raw_string(t, key, schema, rules, value, RawText(quote, avoid), spell)
                if closed is not None:
                    closed = f"{q} {closed}"
                elif scalars_only and not _scalar(schema):
                    raise InvalidRequest(
                        f"tools[{t.index}] parameter {key!r}: this model's tool calls "
                        "hold strings, numbers, booleans and null only"
                    )
                rules.append(f"{value}: {closed or json_value(t, schema)}")
                bare = re.fullmatch(r"\w+", key) and not scalars_only
                name = key if bare or scalars_only else json.dumps(key)
                params.append((f"{lark(name + ':')} {value}", required))
            items = comma_list(params, lark(","))
            return f'{lark(f"call:{t.name}")} "{{" {items} "}}"'

        return one_of("br_call", tools, rules, call)

    return calls


def _scalar(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    return all(k in ("integer", "number", "boolean", "null") for k in kinds) and not any(
        k in schema for k in ("anyOf", "oneOf", "allOf", "$ref", "properties", "items")
    )
