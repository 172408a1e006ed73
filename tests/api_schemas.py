"""Response objects and stream events checked against the API owners' published schemas.

`tests/schemas/` keeps the parts of OpenAI's and Anthropic's OpenAPI documents that describe
what this server answers (see its NOTICE for where they came from and extract.py for how
they were cut); `validate(api, name, value)` checks one object or event against one named
schema with an OpenAPI 3.1 validator, and raises with every error found, each at its path.
`check_sse` does the same for a whole server-sent event stream, event by event.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from jsonschema import validators
from jsonschema.exceptions import ValidationError, best_match
from openapi_schema_validator import OAS31Validator

SCHEMAS = Path(__file__).parent / "schemas"
# Each stream's events by the schema that describes them.
STREAM_EVENTS = {
    "chat": ("openai", "CreateChatCompletionStreamResponse"),
    "completions": ("openai", "CreateCompletionResponse"),
    "responses": ("openai", "ResponseStreamEvent"),
    "anthropic": ("anthropic", "MessageStreamEvent"),
}


def _or_null(check):
    """A keyword's check that lets `null` through where the schema says `nullable: true`."""

    def checked(validator, value, instance, schema):
        if instance is None and schema.get("nullable") is True:
            return
        yield from check(validator, value, instance, schema)

    return checked


# OpenAI's document is OpenAPI 3.1 but still marks a few schemas `nullable: true` (3.0's
# word for it; 3.1 spells it `type: [..., "null"]`): read as the document means it, as
# the SDKs generated from it do.
Validator = validators.extend(
    OAS31Validator,
    {k: _or_null(OAS31Validator.VALIDATORS[k]) for k in ("type", "enum")},
)


@functools.cache
def _document(api: str) -> dict[str, Any]:
    return json.loads((SCHEMAS / f"{api}.json").read_text())


@functools.cache
def _validator(api: str, name: str):
    doc = _document(api)
    if name not in doc["components"]["schemas"]:
        raise KeyError(f"{name} is not among tests/schemas/{api}.json's schemas")
    # `#/components/schemas/...` references resolve against this root.
    schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    return Validator(schema)


def _branch_errors(error: ValidationError) -> list[ValidationError]:
    """The errors that say why `value` is none of a oneOf/anyOf's branches: those of the
    branch meant (the one whose `type` property the value matches, as the documents'
    discriminators choose), else of the branch that came closest."""
    if not error.context:
        return [error]
    branches: dict[Any, list[ValidationError]] = {}
    for sub in error.context:
        branches.setdefault(sub.relative_schema_path[0], []).append(sub)
    depth = len(error.absolute_path)

    def wrong_kind(sub: ValidationError) -> bool:
        """The value is not of this branch's kind: another JSON type, or another `type`."""
        path = list(sub.absolute_path)[depth:]
        return (path == ["type"] and sub.validator in ("const", "enum")) or (
            not path and sub.validator == "type"
        )

    meant = [b for b in branches.values() if not any(map(wrong_kind, b))]
    if len(meant) != 1:
        return [best_match(error.context)]
    return [leaf for sub in meant[0] for leaf in _branch_errors(sub)]


def errors(api: str, name: str, value: Any) -> list[str]:
    """Every way `value` breaks schema `name` of `api`'s document."""
    found = []
    for error in _validator(api, name).iter_errors(value):
        for leaf in _branch_errors(error):
            path = "/".join(str(p) for p in leaf.absolute_path) or "(top)"
            found.append(f"{path}: {leaf.message[:300]}")
    return found


def validate(api: str, name: str, value: Any) -> Any:
    """`value`, if it is valid against schema `name`; an AssertionError saying how not."""
    found = errors(api, name, value)
    assert not found, f"not a valid {api} {name}:\n  " + "\n  ".join(found) + f"\n{value}"
    return value


def sse_events(body: str) -> list[tuple[str, Any]]:
    """A server-sent event stream's (event name, parsed data) pairs; `[DONE]` as a string."""
    events = []
    for block in body.replace("\r\n", "\n").split("\n\n"):
        name, data = "", []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
        if data:
            text = "\n".join(data)
            events.append((name, text if text == "[DONE]" else json.loads(text)))
    return events


def check_sse(kind: str, body: str) -> list[Any]:
    """Every event of a `kind` stream (a key of STREAM_EVENTS) validated; their data.
    Anthropic's events must also name their type in the `event:` line."""
    api, name = STREAM_EVENTS[kind]
    out = []
    for event, data in sse_events(body):
        if data == "[DONE]":
            continue
        if kind == "anthropic" and data.get("type") != "error":
            assert event == data["type"], (event, data)
        if data.get("type") == "error" or "error" in data:
            raise AssertionError(f"the stream carried an error: {data}")
        checked = data
        if kind == "completions":
            # A gap in OpenAI's document: streamed completions are described by the final
            # object's schema, whose finish_reason is a string, but every chunk before the
            # last carries `finish_reason: null` (as OpenAI's own streams do).
            checked = {
                **data,
                "choices": [{**c, "finish_reason": c["finish_reason"] or "stop"}
                            for c in data["choices"]],
            }  # fmt: skip
        validate(api, name, checked)
        out.append(data)
    return out
