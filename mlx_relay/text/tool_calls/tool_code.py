"""Gemma tool calls: a fenced block opened by three backticks and ``tool_code``, holding
Python calls like ``func(a=1, b="x")``, read with ``ast`` and never evaluated.

mlx-lm's parser contract (see hermes.py). The grammar writes keyword arguments whose
values are JSON literals (the parser reads JSON's true/false/null); a cut call is cut
at a ``(`` or ``,`` and closed with ``)``.
"""

from __future__ import annotations

import ast
import textwrap

from mlx_relay.text.tool_calls.base import Cuts, ToolSyntax
from mlx_relay.text.tool_calls.common import literal, properties, tool_schemas
from mlx_relay.text.tool_calls.shapes import keyword_calls

tool_call_start = "```tool_code"
tool_call_end = "```"


def _dotted_name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted_name(node.value)}.{node.attr}"
    raise ValueError("not a function name")


def _python_call(node: ast.AST, schemas: dict[str, dict]) -> dict:
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
        # Reported as an unknown tool; its arguments do not matter.
        return {"name": name, "arguments": {}}
    params = list(properties(schemas.get(name)))
    if len(node.args) > len(params):
        raise ValueError(f"{name}: positional arguments not in the tool's schema")
    args = {}
    for param, arg in zip(params, node.args, strict=False):
        if isinstance(arg, ast.Starred):
            raise ValueError("*args in a tool call")
        args[param] = literal(arg)
    for keyword in node.keywords:
        if keyword.arg is None or keyword.arg in args:
            raise ValueError(f"{name}: bad or repeated keyword argument")
        args[keyword.arg] = literal(keyword.value)
    return {"name": name, "arguments": args}


def parse_tool_call(text: str, tools: list[dict] | None = None) -> list[dict]:
    """Python calls, one per line (or a list of calls); positional arguments take
    their names from the order of the tool schema's ``properties``."""
    try:
        tree = ast.parse(textwrap.dedent(text).strip(), mode="exec")
    except (SyntaxError, ValueError, RecursionError) as e:
        raise ValueError(f"tool_code is not Python: {e}") from e
    schemas = tool_schemas(tools)
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


SYNTAXES = (ToolSyntax("tool_code", keyword_calls, partial=Cuts(("(", ","), ")")),)
