"""Split a streamed generation into content, reasoning and tool calls.

Rank 0 detokenizes one token at a time and feeds the text here. Reasoning (text
between the think markers) and tool-call markup never reach the client as
content: reasoning goes out as reasoning deltas, and each tool call goes out as
one structured call the moment its closing markup arrives.

Like a stop-string holdback, only the tail that could still become a marker is
held back; all other text is released as soon as it arrives. Whitespace that
only separates content from markup (``</think>\\n\\n``, newlines between tool
calls) is dropped, so trailing whitespace of content waits for the next
non-whitespace character to show whether it separates text or precedes markup.

Tool-call formats (resolved once per model, see markup.py): the tokenizer's own
mlx-lm parser when it has one, otherwise the formats below, recognised by their markup:

- hermes/JSON: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
- Qwen XML: ``<tool_call><function=NAME><parameter=P>v</parameter></function></tool_call>``
- Gemma: a fenced block opened by three backticks and ``tool_code``, holding
  Python calls like ``func(a=1, b="x")`` (read with ``ast``, never evaluated)

Markup that does not parse is passed on as content and flagged as malformed,
so a bad generation is visible instead of raising or silently vanishing.
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlx_relay.coordinator.markup import ChatMarkup

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_CODE_START = "```tool_code"
TOOL_CODE_END = "```"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object
    index: int  # position among this response's tool calls


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class Final(Delta):
    """The last delta (whatever was held back) plus what went wrong in the response."""

    malformed_tool_call: bool = False
    unknown_tools: list[str] = field(default_factory=list)


def _held_prefix_len(text: str, markers: list[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


def _find_first(text: str, markers: list[str]) -> tuple[int, str] | None:
    """The earliest complete marker in ``text`` (the longest one on a tie)."""
    best: tuple[int, str] | None = None
    for marker in markers:
        i = text.find(marker)
        if i < 0:
            continue
        if best is None or i < best[0] or (i == best[0] and len(marker) > len(best[1])):
            best = (i, marker)
    return best


# --- tool schemas -----------------------------------------------------------------


def _tool_schemas(tools: list[dict] | None) -> dict[str, dict]:
    """Map tool name -> JSON schema of its parameters, from OpenAI-shaped tools."""
    schemas = {}
    for tool in tools or []:
        if not isinstance(tool, dict):
            continue
        function = tool.get("function", tool)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        params = function.get("parameters")
        schemas[function["name"]] = params if isinstance(params, dict) else {}
    return schemas


def _properties(schema: dict | None) -> dict[str, Any]:
    props = (schema or {}).get("properties")
    return props if isinstance(props, dict) else {}


# --- hermes / JSON ------------------------------------------------------------------


def name_and_arguments(obj: Any) -> tuple[str, dict]:
    """Read one call object; string arguments holding JSON are decoded exactly once."""
    if not isinstance(obj, dict):
        raise ValueError("a tool call must be a JSON object")
    if isinstance(obj.get("function"), dict):
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("a tool call needs a name")
    args = obj.get("arguments", obj.get("parameters"))
    if args is None:
        args = {}
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    if not isinstance(args, dict):
        raise ValueError("tool call arguments must be an object")
    return name, args


def parse_hermes(body: str, tools: list[dict] | None = None) -> list[tuple[str, dict]]:
    """``{"name": ..., "arguments": {...}}``: one object, several in a row, or a list."""
    decoder = json.JSONDecoder()
    text = body.strip()
    calls = []
    pos = 0
    while pos < len(text):
        obj, pos = decoder.raw_decode(text, pos)
        for item in obj if isinstance(obj, list) else [obj]:
            calls.append(name_and_arguments(item))
        while pos < len(text) and (text[pos].isspace() or text[pos] == ","):
            pos += 1
    if not calls:
        raise ValueError("empty tool call")
    return calls


# --- Qwen XML -----------------------------------------------------------------------

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
            value = _literal(ast.parse(text, mode="eval").body)
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


def parse_qwen_xml(body: str, tools: list[dict] | None = None) -> list[tuple[str, dict]]:
    """``<function=NAME><parameter=P>value</parameter></function>``, one or more."""
    schemas = _tool_schemas(tools)
    calls = []
    for match in _FUNCTION_RE.finditer(body):
        name = match.group(1).strip()
        props = _properties(schemas.get(name))
        args = {}
        for param in _PARAMETER_RE.finditer(match.group(2)):
            key = param.group(1).strip()
            args[key] = _typed_value(_strip_one_newline(param.group(2)), props.get(key))
        if _PARAMETER_RE.sub("", match.group(2)).strip():
            raise ValueError(f"unexpected text in function {name!r}")
        calls.append((name, args))
    if not calls or _FUNCTION_RE.sub("", body).strip():
        raise ValueError("not a sequence of <function=...> blocks")
    return calls


# --- Gemma tool_code ------------------------------------------------------------------

_NAMED_LITERALS = {"true": True, "false": False, "null": None}


def _literal(node: ast.AST) -> Any:
    """The value of a literal expression, without evaluating anything.

    JSON's true/false/null are accepted too, since templates render nested
    values as JSON.
    """
    if isinstance(node, ast.Constant) and not isinstance(node.value, bytes | complex):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMED_LITERALS:
        return _NAMED_LITERALS[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(elt) for elt in node.elts]
    if isinstance(node, ast.Dict):
        if any(key is None for key in node.keys):
            raise ValueError("** in a literal dict")
        out = {}
        for key, value in zip(node.keys, node.values, strict=True):
            k = _literal(key)
            if not isinstance(k, str | int | float | bool) and k is not None:
                raise ValueError("unsupported dict key")
            out[k] = _literal(value)
        return out
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub | ast.UAdd)
        and isinstance(node.operand, ast.Constant)
        and isinstance(node.operand.value, int | float)
        and not isinstance(node.operand.value, bool)
    ):
        value = node.operand.value
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError(f"not a literal: {ast.dump(node)[:80]}")


def _dotted_name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted_name(node.value)}.{node.attr}"
    raise ValueError("not a function name")


def _python_call(node: ast.AST, schemas: dict[str, dict]) -> tuple[str, dict]:
    if not isinstance(node, ast.Call):
        raise ValueError("not a function call")
    name = _dotted_name(node.func)
    # Gemma's examples wrap the call as print(tool(...)).
    if (
        name == "print"
        and name not in schemas
        and len(node.args) == 1
        and not node.keywords
        and isinstance(node.args[0], ast.Call)
    ):
        return _python_call(node.args[0], schemas)
    if schemas and name not in schemas:
        return name, {}  # reported as an unknown tool; its arguments do not matter
    params = list(_properties(schemas.get(name)))
    if len(node.args) > len(params):
        raise ValueError(f"{name}: positional arguments not in the tool's schema")
    args = {}
    for param, arg in zip(params, node.args, strict=False):
        if isinstance(arg, ast.Starred):
            raise ValueError("*args in a tool call")
        args[param] = _literal(arg)
    for keyword in node.keywords:
        if keyword.arg is None or keyword.arg in args:
            raise ValueError(f"{name}: bad or repeated keyword argument")
        args[keyword.arg] = _literal(keyword.value)
    return name, args


def parse_tool_code(body: str, tools: list[dict] | None = None) -> list[tuple[str, dict]]:
    """Python calls, one per line (or a list of calls); positional arguments take
    their names from the order of the tool schema's ``properties``."""
    try:
        tree = ast.parse(textwrap.dedent(body).strip(), mode="exec")
    except (SyntaxError, ValueError, RecursionError) as e:
        raise ValueError(f"tool_code is not Python: {e}") from e
    schemas = _tool_schemas(tools)
    calls = []
    for stmt in tree.body:
        if not isinstance(stmt, ast.Expr):
            raise ValueError("tool_code may only hold calls")
        value = stmt.value
        nodes = value.elts if isinstance(value, ast.List | ast.Tuple) else [value]
        calls.extend(_python_call(node, schemas) for node in nodes)
    if not calls:
        raise ValueError("empty tool_code")
    return calls


def parse_tool_call_block(body: str, tools: list[dict] | None = None) -> list[tuple[str, dict]]:
    """What follows ``<tool_call>`` decides the format: ``{`` is hermes, ``<function=`` Qwen XML."""
    text = body.lstrip()
    if text.startswith("<function="):
        return parse_qwen_xml(body, tools)
    if text.startswith(("{", "[")):
        return parse_hermes(body, tools)
    raise ValueError("unknown <tool_call> format")


# --- the streaming parser ---------------------------------------------------------------


class OutputParser:
    """Incrementally split generated text into content, reasoning and tool calls.

    ``feed`` each detokenized segment and send the returned delta; ``finish``
    flushes what was held back. The ``content``, ``reasoning`` and ``tool_calls``
    attributes are the aggregates of everything returned so far.
    """

    def __init__(
        self,
        markup: ChatMarkup | None = None,
        *,
        tools: list[dict] | None = None,
        starts_in_reasoning: bool = False,
        parse_tools: bool = True,
        opens_tool_call: str = "",
    ) -> None:
        """``markup``: the loaded model's (None: the default markers and our own tool
        formats). ``opens_tool_call``: the prompt ends with this tool-call marker
        (``tool_choice`` forced a call), so generation starts inside the call's body."""
        if markup is None:
            from mlx_relay.coordinator.markup import ChatMarkup

            markup = ChatMarkup.of(None)
        self.think_start, self.think_end = markup.think_start, markup.think_end
        self.tools = tools or None
        self._known = set(_tool_schemas(tools)) if tools else None

        # Tool-call blocks: start marker -> (end marker, body parser).
        self._blocks: dict[str, tuple[str, Callable]] = {}
        if parse_tools:
            for fmt in markup.tool_formats:
                self._blocks[fmt.start] = (fmt.end, fmt.parse)
        self._content_markers = [self.think_start, *self._blocks]

        self.content = ""
        self.reasoning = ""
        self.tool_calls: list[ToolCall] = []
        self.malformed_tool_call = False
        self.unknown_tools: list[str] = []

        self._buf = ""  # text not yet classified
        self._mode = "reasoning" if starts_in_reasoning else "content"
        self._block_start = ""  # start marker of the open tool-call block
        self._end_search_from = 0  # where to resume looking for its end marker
        self._done = False
        if opens_tool_call in self._blocks:
            self._mode = "tool"
            self._block_start = opens_tool_call
        # Whitespace bookkeeping, see _emit_content and _emit_reasoning.
        self._ws = ""
        self._ws_before_block = ""
        self._content_started = False
        self._markup_seen = starts_in_reasoning or self._mode == "tool"
        self._ws_after_markup = False
        self._reasoning_ws = ""
        self._reasoning_started = False

    @property
    def in_reasoning(self) -> bool:
        return self._mode == "reasoning"

    @property
    def saw_tool_calls(self) -> bool:
        return bool(self.tool_calls)

    def feed(self, text: str) -> Delta:
        delta = Delta()
        if self._done:
            return delta
        self._buf += text
        self._scan(delta, final=False)
        self._record(delta)
        return delta

    def finish(self) -> Final:
        final = Final()
        if not self._done:
            self._done = True
            self._scan(final, final=True)
            if self._ws and not self._ws_after_markup:
                final.content += self._ws
            self._ws = self._reasoning_ws = ""
            self._record(final)
        final.malformed_tool_call = self.malformed_tool_call
        final.unknown_tools = list(self.unknown_tools)
        return final

    def _record(self, delta: Delta) -> None:
        self.content += delta.content
        self.reasoning += delta.reasoning
        self.tool_calls.extend(delta.tool_calls)

    def _scan(self, delta: Delta, final: bool) -> None:
        """Classify as much of the buffer as is certain, in order."""
        while True:
            if self._mode == "content":
                hit = _find_first(self._buf, self._content_markers)
                if hit is None:
                    keep = 0 if final else _held_prefix_len(self._buf, self._content_markers)
                    self._emit_content(self._buf[: len(self._buf) - keep], delta)
                    self._buf = self._buf[len(self._buf) - keep :]
                    return
                i, marker = hit
                self._emit_content(self._buf[:i], delta)
                self._buf = self._buf[i + len(marker) :]
                self._ws_before_block, self._ws = self._ws, ""
                if marker == self.think_start:
                    self._mode = "reasoning"
                    self._reasoning_started = False
                else:
                    self._mode = "tool"
                    self._block_start = marker
                    self._end_search_from = 0
            elif self._mode == "reasoning":
                if not self._reasoning_started:
                    # Generation that starts inside reasoning may repeat the marker.
                    head = self._buf.lstrip()
                    if head.startswith(self.think_start):
                        self._buf = head[len(self.think_start) :]
                    elif head and self.think_start.startswith(head) and not final:
                        return
                i = self._buf.find(self.think_end)
                if i < 0:
                    keep = 0 if final else _held_prefix_len(self._buf, [self.think_end])
                    self._emit_reasoning(self._buf[: len(self._buf) - keep], delta)
                    self._buf = self._buf[len(self._buf) - keep :]
                    return
                self._emit_reasoning(self._buf[:i], delta)
                self._buf = self._buf[i + len(self.think_end) :]
                self._reasoning_ws = ""
                self._mode = "content"
                self._markup_seen = self._ws_after_markup = True
            else:
                end, parse = self._blocks[self._block_start]
                # Long calls arrive in many pieces: only search the new text.
                i = self._buf.find(end, self._end_search_from) if end else -1
                if i < 0 and not final:
                    self._end_search_from = max(0, len(self._buf) - len(end) + 1)
                    return
                # An unclosed block at the end still counts if it parses completely.
                body = self._buf[:i] if i >= 0 else self._buf
                raw = self._block_start + body + (end if i >= 0 else "")
                self._buf = self._buf[i + len(end) :] if i >= 0 else ""
                self._mode = "content"
                self._close_block(body, raw, parse, delta)

    def _close_block(self, body: str, raw: str, parse: Callable, delta: Delta) -> None:
        try:
            calls = parse(body, self.tools)
            arguments = [json.dumps(args, ensure_ascii=False) for _, args in calls]
        except Exception:
            # Not a tool call after all (and never an error that ends the response):
            # the client sees exactly what the model wrote.
            self.malformed_tool_call = True
            self._ws = self._ws_before_block
            self._emit_content(raw, delta)
            return
        for (name, _), args in zip(calls, arguments, strict=True):
            if self._known is not None and name not in self._known:
                self.unknown_tools.append(name)
                continue
            call = ToolCall(
                id=f"call_{secrets.token_hex(6)}",
                name=name,
                arguments=args,
                index=len(self.tool_calls) + len(delta.tool_calls),
            )
            delta.tool_calls.append(call)
        self._markup_seen = self._ws_after_markup = True

    def _emit_content(self, text: str, delta: Delta) -> None:
        """Send content, holding trailing whitespace until something follows it.

        Whitespace directly before markup is dropped; so is whitespace after
        markup when no content came before (``</think>\\n\\nAnswer``) or nothing
        comes after. Between content on both sides it stays as the separator.
        """
        body = text.lstrip()
        if not body:
            self._ws += text
            return
        lead = self._ws + text[: len(text) - len(body)]
        core = body.rstrip()
        if not self._content_started and self._markup_seen:
            lead = ""
        delta.content += lead + core
        self._ws = body[len(core) :]
        self._content_started = True
        self._ws_after_markup = False

    def _emit_reasoning(self, text: str, delta: Delta) -> None:
        """Send reasoning without the whitespace at the edges of a think block."""
        if not self._reasoning_started:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self._reasoning_ws += text
            return
        delta.reasoning += self._reasoning_ws + body
        self._reasoning_ws = text[len(body) :]
        self._reasoning_started = True
