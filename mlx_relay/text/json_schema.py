"""JSON Schema as a grammar: the one whitespace rule, a schema's grammar, a schema checked.

Both kinds of JSON a request can hold a model to use these: OpenAI's `response_format`
(constraints.py) and a tool's arguments (tool_calls/rules.py), so both refuse the same
schemas and allow the same whitespace.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
from jsonschema import exceptions as schema_errors
from jsonschema import validators

from mlx_relay.errors import InvalidRequest

# Between JSON tokens: nothing, one space, or one or two newlines and an indent of at
# most 20, as llama.cpp's JSON-schema grammars allow. Unbounded whitespace lets a model
# (a small one especially) emit blank lines until max_tokens and never close the JSON.
JSON_WHITESPACE = r"( |\n{1,2}[ \t]{0,20})?"


def json_schema_grammar(schema: dict[str, Any] | bool) -> str:
    """An llguidance grammar for JSON that `schema` accepts (its own x-guidance wins)."""
    return llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), defaults={"whitespace_pattern": JSON_WHITESPACE}
    )


def check_schema(
    schema: dict[str, Any] | bool, field: str = "response_format.json_schema.schema"
) -> None:
    """Refuse a schema that is not valid JSON Schema (by its own $schema, else 2020-12)."""
    cls = validators.validator_for(schema, default=validators.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except schema_errors.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        at = f" at schema/{where}" if where else ""
        raise InvalidRequest(f"{field} is not a valid JSON Schema{at}: {e.message}") from e
