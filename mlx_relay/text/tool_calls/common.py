"""What the fallback tool parsers share: the request's tool schemas, literal values read
without evaluating anything, and the one shape every call is brought to."""

from __future__ import annotations

import ast
import json
from typing import Any


def tool_schemas(tools: list[dict] | None) -> dict[str, dict]:
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


def properties(schema: dict | None) -> dict[str, Any]:
    props = (schema or {}).get("properties")
    return props if isinstance(props, dict) else {}


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


_NAMED_LITERALS = {"true": True, "false": False, "null": None}


def literal(node: ast.AST) -> Any:
    """The value of a literal expression, without evaluating anything.

    JSON's true/false/null are accepted too, since templates render nested
    values as JSON.
    """
    if isinstance(node, ast.Constant) and not isinstance(node.value, bytes | complex):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMED_LITERALS:
        return _NAMED_LITERALS[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [literal(elt) for elt in node.elts]
    if isinstance(node, ast.Dict):
        if any(key is None for key in node.keys):
            raise ValueError("** in a literal dict")
        out = {}
        for key, value in zip(node.keys, node.values, strict=True):
            k = literal(key)
            if not isinstance(k, str | int | float | bool) and k is not None:
                raise ValueError("unsupported dict key")
            out[k] = literal(value)
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
