"""Grammars of the tool-call formats of mlx-lm's other parsers (``mlx_lm/tool_parsers``).

Each rule spells one call the way that family's chat template shows it and its parser
reads it back (tests/test_tool_constraint.py walks every grammar and parses the result
with mlx-lm's parser): the name of an allowed tool, then its arguments in the order of
the schema's ``properties``, the required ones always there. How a value is written
follows what the parser does with it:

- ``glm47`` (GLM 4.7, Laguna) and ``longcat``:
  ``N<arg_key>k</arg_key><arg_value>v</arg_value>``; a string-typed value is raw text
  (the parser strips it, so it neither begins nor ends in whitespace), any other the
  JSON text the parser decodes;
- ``kimi_k2``: ``<|tool_call_begin|>functions.N:0<|tool_call_argument_begin|>{...}
  <|tool_call_end|>``, the arguments one JSON object;
- ``kimi_k3``: ``<|open|>call tool="N" index="1"<|sep|>`` holding the arguments as one
  JSON block (``<|open|>json type="object"<|sep|>{...}<|close|>json<|sep|>``);
- ``minimax_m2`` (``<invoke name="N"><parameter name="k">v</parameter></invoke>``) and
  ``minicpm5`` (``"N"><param name="k">v</param>`` after ``<function name=``): strings
  raw (stripped, never the word null), other values JSON text;
- ``muse_spark``: ``<atem:invoke name="N"><atem:parameter name="k">v</atem:parameter>
  </atem:invoke>``, every value JSON text (the parser decodes JSON first);
- ``gemma4``: ``call:N{k:<|"|>text<|"|>,k2:1}``: strings between ``<|"|>``, other values
  JSON;
- ``function_gemma``: ``call:N{k:<escape>text<escape>,k2:1}``; its parser ends the call
  at the first ``}`` and a value at the next comma, so only strings, numbers, booleans
  and null can be written (a tool with other arguments cannot be enforced).
"""

from __future__ import annotations

import json
import re
from typing import Any

from mlx_relay.coordinator.requests import InvalidRequest
from mlx_relay.coordinator.tool_grammars import (
    _MORE,
    RawText,
    Spell,
    Tool,
    _arguments,
    _comma_list,
    _guided,
    _lark,
    _one_of,
    raw_string,
)


def _json_value(tool: Tool, schema: Any) -> str:
    return f"%json {json.dumps(_guided(tool, schema), ensure_ascii=False)}"


def _closed_value(
    tool: Tool,
    key: str,
    schema: Any,
    rules: list[str],
    rule: str,
    spell: Spell,
    close: str,
    raw: RawText | None,
) -> None:
    """Rule `rule`: an argument's value and the marker `close` after it; a string is raw
    text as `raw` says (None: every value JSON text)."""
    closed = raw_string(tool, key, schema, rules, rule, raw, spell) if raw else None
    rules.append(f"{rule}: {closed or _json_value(tool, schema) + ' ' + spell(close)}")


def _keyed(key_open: str, key_close: str, value_open: str, value_close: str):
    """GLM 4.7's and LongCat's `N<arg_key>k</arg_key><arg_value>v</arg_value>`."""

    def calls(tools: list[Tool], rules: list[str], spell: Spell) -> str:
        def call(t: Tool) -> str:
            params = []
            for j, (key, schema, required) in enumerate(t.properties):
                value = f"kv_{t.index}_{j}"
                typed = isinstance(schema, dict) and schema.get("type") == "string"
                raw = RawText(value_close, trimmed=True) if typed else None
                _closed_value(t, key, schema, rules, value, spell, value_close, raw)
                params.append(
                    (
                        f"{spell(key_open)} {_lark(key)} {spell(key_close)} WS? "
                        f"{spell(value_open)} {value}",
                        required,
                    )
                )
            return f"{_lark(t.name)} WS? {_comma_list(params, 'WS?')}"

        return _one_of("keyed_call", tools, rules, call)

    return calls


def _kimi_k2(tools: list[Tool], rules: list[str], spell: Spell) -> str:
    def call(t: Tool) -> str:
        return (
            f"{spell('<|tool_call_begin|>')} {_lark(f'functions.{t.name}:')} /[0-9]{{1,3}}/ "
            f"{spell('<|tool_call_argument_begin|>')} {_arguments(t, rules)} "
            f"{spell('<|tool_call_end|>')}"
        )

    return _one_of("k2_call", tools, rules, call)


def _kimi_k3(tools: list[Tool], rules: list[str], spell: Spell) -> str:
    opened, sep, closed = spell("<|open|>"), spell("<|sep|>"), spell("<|close|>")

    def call(t: Tool) -> str:
        name = t.name.replace("&", "&amp;").replace('"', "&quot;")
        return (
            f'{opened} {_lark(f"call tool={json.dumps(name)} index=")} /"[0-9]{{1,3}}"/ {sep} '
            f'WS? {opened} "json type=\\"object\\"" {sep} {_arguments(t, rules)} '
            f'{closed} "json" {sep} WS? {closed} "call" {sep}'
        )

    return _one_of("k3_call", tools, rules, call)


def _tagged(invoke: str, invoke_end: str, param: str, param_end: str, *, raw: bool):
    """MiniMax M2's, MiniCPM5's and Muse Spark's XML: `invoke` is what precedes the quoted
    name, `param` what precedes a quoted argument name. `raw`: strings are raw text."""

    def calls(tools: list[Tool], rules: list[str], spell: Spell) -> str:
        def call(t: Tool) -> str:
            params = []
            for j, (key, schema, required) in enumerate(t.properties):
                value = f"tag_{t.index}_{j}"
                avoid = (invoke_end,) if invoke_end else ()
                text = RawText(param_end, avoid, trimmed=True, not_null=True) if raw else None
                _closed_value(t, key, schema, rules, value, spell, param_end, text)
                tag = _lark(f"{param}{json.dumps(key)}>")
                params.append((f"{tag} {value}", required))
            head = _lark(f"{invoke}{json.dumps(t.name)}>")
            end = f" WS? {_lark(invoke_end)}" if invoke_end else ""
            return f"{head} WS? {_comma_list(params, 'WS?')}{end}"

        return _one_of("tag_call", tools, rules, call)

    return calls


def _braced(quote: str, *, scalars_only: bool):
    """Gemma 4's and FunctionGemma's `call:N{k:v,...}`, strings between `quote`."""

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
                rules.append(f"{value}: {closed or _json_value(t, schema)}")
                bare = re.fullmatch(r"\w+", key) and not scalars_only
                name = key if bare or scalars_only else json.dumps(key)
                params.append((f"{_lark(name + ':')} {value}", required))
            items = _comma_list(params, _lark(","))
            return f'{_lark(f"call:{t.name}")} "{{" {items} "}}"'

        return _one_of("br_call", tools, rules, call)

    return calls


def _scalar(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    return all(k in ("integer", "number", "boolean", "null") for k in kinds) and not any(
        k in schema for k in ("anyOf", "oneOf", "allOf", "$ref", "properties", "items")
    )


_MORE.update(
    {
        "glm47": _keyed("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
        "longcat": _keyed(
            "<longcat_arg_key>",
            "</longcat_arg_key>",
            "<longcat_arg_value>",
            "</longcat_arg_value>",
        ),
        "kimi_k2": _kimi_k2,
        "kimi_k3": _kimi_k3,
        "minimax_m2": _tagged(
            "<invoke name=", "</invoke>", "<parameter name=", "</parameter>", raw=True
        ),
        "minicpm5": _tagged("", "", "<param name=", "</param>", raw=True),
        "muse_spark": _tagged(
            "<atem:invoke name=",
            "</atem:invoke>",
            "<atem:parameter name=",
            "</atem:parameter>",
            raw=False,
        ),
        "gemma4": _braced('<|"|>', scalars_only=False),
        "function_gemma": _braced("<escape>", scalars_only=True),
    }
)
