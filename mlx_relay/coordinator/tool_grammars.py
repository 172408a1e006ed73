"""Grammars of tool calls, one per call format a model may write.

A forced call (tool_choice required or named) and, under `auto`, a call the model opens
itself are held to the same rules: the name of an allowed tool, then arguments valid
against that tool's JSON schema, spelled the way the model's format spells them.
`call_grammar` gives the llguidance grammar of the text after the format's start marker:

- forced: one call, complete once the call closes (the request then ends; the output
  parser reads the unclosed block at the end as the call);
- auto (`closes=True`): one call, then the end marker, after which the grammar is done
  and the model writes free text again (`tool_constraint.ToolCallWatch`). A format
  without an end marker (Mistral's) runs to the end of the output: its calls are the
  whole rest of it.

Formats (`ChatMarkup.tool_syntax` names them):

- ``hermes``: ``{"name": N, "arguments": {...}}`` inside ``<tool_call>`` (Qwen 2.5/3,
  Hermes, the fallback prompt);
- ``qwen_xml``: ``<function=N><parameter=P>value</parameter></function>`` inside
  ``<tool_call>`` (Qwen3-Coder): strings are raw text, other values JSON text;
- ``mistral_json``: ``[TOOL_CALLS][{"name": N, "arguments": {...}}, ...]``;
- ``mistral_args``: ``[TOOL_CALLS]N[ARGS]{...}``, repeatable;
- ``tool_code``: Gemma's fenced ``N(key=value)``, values as JSON literals (the parser
  reads JSON's true/false/null);
- ``pythonic``: ``<|tool_call_start|>[N(key=value), ...]<|tool_call_end|>`` (LFM2);
- the formats of mlx-lm's other parsers, in tool_grammars_more.py: ``glm47`` (GLM 4.7,
  Laguna), ``longcat``, ``kimi_k2``, ``kimi_k3``, ``minimax_m2``, ``minicpm5``,
  ``muse_spark``, ``gemma4``, ``function_gemma``.

A `strict` tool's schema must be enforceable in full (else InvalidRequest); other tools'
schemas are enforced leniently (keywords llguidance does not support are ignored), so a
tool accepted before is not refused now. Keyword and XML arguments follow the order of
the schema's ``properties``; required ones must appear.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llguidance

from mlx_relay.coordinator.constraints import JSON_WHITESPACE, check_schema
from mlx_relay.coordinator.requests import InvalidRequest

# Spells a marker in lark: a quoted literal, or the special token it also is.
Spell = Callable[[str], str]
NAME, ARGUMENTS = '"name"', '"arguments"'  # the keys of a JSON call, quoted
# JSON_WHITESPACE as a lexeme (written WS? where it may be absent: a lexeme is never empty).
WS = r"WS: / |\n{1,2}[ \t]{0,20}/"
SYNTAXES = (
    "hermes",
    "qwen_xml",
    "mistral_json",
    "mistral_args",
    "tool_code",
    "pythonic",
    "glm47",
    "longcat",
    "kimi_k2",
    "kimi_k3",
    "minimax_m2",
    "minicpm5",
    "muse_spark",
    "gemma4",
    "function_gemma",
)
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


def any_strict(tools: list[dict]) -> bool:
    return any(t.strict for t in tools_of(tools))


def call_grammar(
    syntax: str,
    tools: list[dict],
    *,
    closes: bool,
    end: str = "",
    spell: Spell | None = None,
) -> str:
    """The llguidance grammar of what follows the start marker of a call in `syntax`.

    `closes`: the call is followed by `end` (the format's end marker, if it has one) and
    then by anything, for the watch to notice the call is over; else the grammar is
    complete when the call is. `spell`: how a marker is written in the grammar (default:
    as text only).
    """
    spell = spell or _lark
    parsed = tools_of(tools)
    rules = [WS]
    if syntax in ("hermes", "mistral_json"):
        one = _json_calls(parsed, rules)
    elif syntax == "qwen_xml":
        one = _xml_calls(parsed, rules, spell)
    elif syntax == "mistral_args":
        one = _args_calls(parsed, rules, spell)
    elif syntax in ("tool_code", "pythonic"):
        one = _python_calls(parsed, rules)
    elif syntax in _MORE:
        one = _MORE[syntax](parsed, rules, spell)
    else:
        raise ValueError(f"no grammar for tool-call syntax {syntax!r}")
    if syntax == "mistral_json":
        body = f'"[" WS? {one} (WS? "," WS? {one})* WS? "]"'
    elif syntax == "mistral_args":
        body = f"{one} (WS? {spell('[TOOL_CALLS]')}? WS? {one})*"
    elif syntax == "pythonic":
        body = f'"[" {one} ("," WS? {one})* "]"'
    else:
        body = one
    if closes and end:
        # mlx-lm's Qwen3-Coder parser wants </function> last, but for one newline.
        gap = '"\\n"?' if syntax == "qwen_xml" else "WS?"
        body = f"{body} {gap} {spell(end)} /(?s:.*)/"
    try:
        return llguidance.grammar_from("lark", "\n".join([f"start: WS? {body}", *rules]))
    except ValueError as e:
        raise InvalidRequest(f"tools cannot be enforced: {e}") from e


# --- one call, per format ------------------------------------------------------------

# syntax -> its call rule, (tools, rules, spell) -> rule name; filled by tool_grammars_more.
_MORE: dict[str, Callable[[list[Tool], list[str], Spell], str]] = {}


def _one_of(kind: str, tools: list[Tool], rules: list[str], call: Callable[[Tool], str]) -> str:
    """Rule `kind`: a call of any of `tools`, each `call(tool)` (which may add rules)."""
    names = [f"{kind}_{t.index}" for t in tools]
    rules.extend(f"{name}: {call(t)}" for name, t in zip(names, tools, strict=True))
    rules.append(f"{kind}: {' | '.join(names)}")
    return kind


def _arguments(tool: Tool, rules: list[str]) -> str:
    """Rule of a tool's arguments as one JSON object valid against its schema."""
    rules.append(f"args_{tool.index}: %json {json.dumps(tool.schema, ensure_ascii=False)}")
    return f"args_{tool.index}"


def _json_calls(tools: list[Tool], rules: list[str]) -> str:
    """`{"name": N, "arguments": A}`, whitespace as JSON allows (bounded)."""

    def call(t: Tool) -> str:
        arguments = f'WS? "," WS? {_lark(ARGUMENTS)} WS? ":" WS? {_arguments(t, rules)}'
        if t.takes_no_arguments:  # the parsers read a call without them as {}
            arguments = f"({arguments})?"
        name = _lark(json.dumps(t.name, ensure_ascii=False))
        return f'"{{" WS? {_lark(NAME)} WS? ":" WS? {name} {arguments} WS? "}}"'

    return _one_of("json_call", tools, rules, call)


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
                json_value = f"%json {json.dumps(_guided(t, schema))}"
                closed = f'"\\n"? {json_value} "\\n"? "</parameter>"'
            rules.append(f"{value}: {closed}")
            param = f"{_lark(f'<parameter={key}>')} {value} WS?"
            params.append(param if required else f"({param})?")
        return f'{_lark(f"<function={t.name}>")} WS? {" ".join(params)} "</function>"'

    return _one_of("xml_call", tools, rules, call)


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
    close = _lark(text.close)
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        words = " | ".join(_lark(v) for v in enum)
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


def _takes_string(schema: dict) -> bool:
    """The value is text: a string type, or no type and no JSON-only shape."""
    kind = schema.get("type")
    if kind is None:
        return "enum" in schema or not any(k in schema for k in ("properties", "items"))
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


def _args_calls(tools: list[Tool], rules: list[str], spell: Spell) -> str:
    """Mistral's `N[ARGS]{...}`."""
    return _one_of(
        "args_call",
        tools,
        rules,
        lambda t: f"{_lark(t.name)} {spell('[ARGS]')} {_arguments(t, rules)}",
    )


def _python_calls(tools: list[Tool], rules: list[str]) -> str:
    """`N(key=value, ...)`, keyword arguments only, values as JSON literals."""

    def call(t: Tool) -> str:
        items = []
        for j, (key, schema, required) in enumerate(t.properties):
            value = f"kw_{t.index}_{j}"
            rules.append(f"{value}: %json {json.dumps(_guided(t, schema))}")
            items.append((f'"{key}=" {value}', required))
        return f'{_lark(t.name + "(")} {_comma_list(items)} ")"'

    return _one_of("py_call", tools, rules, call)


def _comma_list(items: list[tuple[str, bool]], sep: str = '"," WS?') -> str:
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


def _guided(tool: Tool, schema: Any) -> Any:
    """An argument's own schema with its tool's x-guidance options (strict or lenient)."""
    if not isinstance(schema, dict):
        return schema
    return {**schema, "x-guidance": tool.schema["x-guidance"]}


def _lark(text: str) -> str:
    """`text` as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


from mlx_relay.coordinator import tool_grammars_more  # noqa: E402, F401 (fills _MORE)
