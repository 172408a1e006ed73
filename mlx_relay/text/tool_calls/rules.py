"""The building blocks of a tool call's grammar, which every format's rule is made of.

A format's module (this package) writes the Lark rule of one of its calls out of these:
the request's tools with their schemas checked (`tools_of`), one alternative per tool
(`one_of`), a tool's arguments as one JSON object (`arguments`), a string argument
written as raw text up to its closing marker (`raw_string`), arguments in the order of
the schema's ``properties`` with the required ones always there (`comma_list`).
`tool_grammars.call_grammar` puts a format's rule into a whole grammar.

A `strict` tool's schema must be enforceable in full (else InvalidRequest); other tools'
schemas are enforced leniently (keywords llguidance does not support are ignored), so a
tool accepted before is not refused now.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlx_relay.errors import InvalidRequest
from mlx_relay.text.json_schema import JSON_WHITESPACE, check_schema

# Spells a marker in lark: a quoted literal, or the special token it also is.
Spell = Callable[[str], str]
NAME, ARGUMENTS = '"name"', '"arguments"'  # the keys of a JSON call, quoted
# JSON_WHITESPACE as a lexeme (written WS? where it may be absent: a lexeme is never empty).
WS = r"WS: / |\n{1,2}[ \t]{0,20}/"
# String keywords a raw-text value (Qwen XML) cannot enforce; a strict tool using them
# is refused there.
_RAW_STRING_UNSUPPORTED = ("pattern", "format")


@dataclass(frozen=True)
class Tool:
    name: str
    schema: dict[str, Any]  # its parameters, with the x-guidance options llguidance reads
    strict: bool
    index: int

    @property
    def properties(self) -> list[tuple[str, Any, bool]]:
        """(name, schema, required) of each declared argument, in declaration order."""
        props = self.schema.get("properties")
        required = self.schema.get("required") or []
        if not isinstance(props, dict):
            return []
        return [(k, v, k in required) for k, v in props.items()]

    @property
    def takes_no_arguments(self) -> bool:
        """`{}` is plainly valid arguments (nothing required, nothing that could require
        it): a call may leave them out, as the parsers read that as `{}`."""
        schema = self.schema
        if schema.get("type", "object") != "object" or schema.get("required"):
            return False
        return not any(
            k in schema for k in ("minProperties", "$ref", "anyOf", "oneOf", "allOf", "not")
        )


# A format's rule of one call: (tools, the grammar's rules so far, spell) -> the name of
# the rule it added (it may add others to `rules`).
CallRule = Callable[[list[Tool], list[str], Spell], str]


def tools_of(tools: list[dict]) -> list[Tool]:
    """The request's tools (OpenAI or Anthropic shape), their schemas checked."""
    out = []
    for i, tool in enumerate(tools):
        function = tool["function"] if isinstance(tool.get("function"), dict) else tool
        strict = function.get("strict") is True or tool.get("strict") is True
        schema = function.get("parameters", function.get("input_schema"))
        if schema is None:
            schema = {"type": "object"}
        if not isinstance(schema, dict):
            raise InvalidRequest(f"tools[{i}] parameters must be a JSON Schema object")
        check_schema(schema, f"tools[{i}] parameters")
        if "type" not in schema:  # arguments are an object whatever else the schema says
            schema = {"type": "object", **schema}
        guidance = {"whitespace_pattern": JSON_WHITESPACE, "lenient": not strict}
        schema = {**schema, "x-guidance": {**guidance, **(schema.get("x-guidance") or {})}}
        out.append(Tool(function["name"], schema, strict, i))
    return out


def one_of(kind: str, tools: list[Tool], rules: list[str], call: Callable[[Tool], str]) -> str:
    """Rule `kind`: a call of any of `tools`, each `call(tool)` (which may add rules)."""
    names = [f"{kind}_{t.index}" for t in tools]
    rules.extend(f"{name}: {call(t)}" for name, t in zip(names, tools, strict=True))
    rules.append(f"{kind}: {' | '.join(names)}")
    return kind


def arguments(tool: Tool, rules: list[str]) -> str:
    """Rule of a tool's arguments as one JSON object valid against its schema."""
    rules.append(f"args_{tool.index}: %json {json.dumps(tool.schema, ensure_ascii=False)}")
    return f"args_{tool.index}"


def json_value(tool: Tool, schema: Any) -> str:
    """One argument's value as JSON text valid against its own schema."""
    return f"%json {json.dumps(guided(tool, schema), ensure_ascii=False)}"


@dataclass(frozen=True)
class RawText:
    """How a format writes a string as raw text: the marker that ends it (`close`), other
    markers it may not hold (`avoid`), whether a newline may open and end it (Qwen's),
    whether its parser strips it (`trimmed`: no whitespace at its edges) and reads the
    word null as null (`not_null`)."""

    close: str
    avoid: tuple[str, ...] = ()
    newlines: bool = False
    trimmed: bool = False
    not_null: bool = False


def raw_string(
    tool: Tool,
    key: str,
    schema: Any,
    rules: list[str],
    rule: str,
    text: RawText,
    spell: Spell,
) -> str | None:
    """The grammar of a string argument written as raw text *and the marker that closes
    it*, or None where the argument is not a string (written as JSON instead).

    The text is one lazy lexeme ending at the first closing marker: a greedy lexeme would
    take the marker's first bytes as text (``Paris</`` is text too) and could then never
    close. Where the marker is also a special token, the text may end at that token.
    """
    if not isinstance(schema, dict) or not _takes_string(schema):
        return None
    close = lark(text.close)
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        words = " | ".join(lark(v) for v in enum)
        pad = '"\\n"? ' if text.newlines else ""
        return f"{pad}({words}) {pad}{spell(text.close)}"
    if tool.strict and any(k in schema for k in _RAW_STRING_UNSUPPORTED):
        raise InvalidRequest(
            f"tools[{tool.index}] parameter {key!r}: "
            f"{' and '.join(k for k in _RAW_STRING_UNSUPPORTED if k in schema)} cannot be "
            "enforced on a string this model writes as raw text (its tool calls); the "
            "tool is strict"
        )
    low, high = schema.get("minLength"), schema.get("maxLength")
    bound = f"{low if isinstance(low, int) else 0},{high if isinstance(high, int) else ''}"
    markers = (text.close, *text.avoid)
    avoid = "|".join(re.escape(m).replace("/", "\\/") for m in markers)
    pad = r"\n?" if text.newlines else ""
    parts = [f"/{pad}(?s:.{{{bound}}}){pad}/", f"~/(?s:.*({avoid}).*)/"]
    if text.trimmed:
        parts.append(r"/(\S((?s:.*)\S)?)?/")
    if text.not_null:
        parts.append(r"~/(?i:null)/")
    lexeme = rule.upper()
    rules.append(f"{lexeme}: {' & '.join(parts)}")
    rules.append(f"{rule}_lazy[lazy]: {lexeme} {close}")
    special = spell(text.close)
    if special == close:
        return f"{rule}_lazy"
    # (the lexeme alone is never empty: an empty string is the lexeme left out)
    return f"({rule}_lazy | {lexeme}? {special})"


def closed_value(
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
    rules.append(f"{rule}: {closed or json_value(tool, schema) + ' ' + spell(close)}")


def _takes_string(schema: dict) -> bool:
    """The value is text: a string type, or no type and no JSON-only shape."""
    kind = schema.get("type")
    if kind is None:
        return "enum" in schema or not any(k in schema for k in ("properties", "items"))
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


def comma_list(items: list[tuple[str, bool]], sep: str = '"," WS?') -> str:
    """Items in order joined by `sep` (commas), the optional ones left out or not, the
    required ones always there: one alternative per item that can come first."""
    if not items:
        return ""
    alternatives = []
    for k, (first, required) in enumerate(items):
        rest = [f"{sep} {item}" if req else f"({sep} {item})?" for item, req in items[k + 1 :]]
        alternatives.append(" ".join([first, *rest]))
        if required:
            break
    whole = " | ".join(f"({a})" for a in alternatives)
    return f"({whole})" if any(req for _, req in items) else f"({whole})?"


def guided(tool: Tool, schema: Any) -> Any:
    """An argument's own schema with its tool's x-guidance options (strict or lenient)."""
    if not isinstance(schema, dict):
        return schema
    return {**schema, "x-guidance": tool.schema["x-guidance"]}


def lark(text: str) -> str:
    """`text` as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)
