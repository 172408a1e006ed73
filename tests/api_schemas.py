"""Response objects and stream events checked against the API owners' published schemas.

`tests/schemas/` keeps the parts of the OpenAPI documents of OpenAI, Anthropic, the Open
Responses specification and Ollama that describe what this server answers (see its NOTICE
for where they came from and extract.py for how they were cut); `validate(api, name,
value)` checks one object or event against one named schema with an OpenAPI 3.1
validator, and raises with every error found, each at its path. `check_sse` does the same
for a whole server-sent event stream, event by event, `check_ndjson` for Ollama's streams.

Anthropic's published document is older than its current SDK (anthropic 2.14 has, e.g.,
`Usage.output_tokens_details`): `validate_sdk` also checks Messages answers against the
installed SDK's own types, as strictly as Anthropic's document reads its own: there every
property of every response object is required (null where there is nothing to say) and
the SDK's types list every field the API sends, so each SDK field must be present and no
other key may be.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from jsonschema import validators
from jsonschema.exceptions import ValidationError, best_match
from openapi_schema_validator import OAS31Validator
from pydantic import TypeAdapter

SCHEMAS = Path(__file__).parent / "schemas"
# Each stream's events by the schema that describes them (besides, the Responses stream's
# against the Open Responses specification and Anthropic's against the SDK's types).
STREAM_EVENTS = {
    "chat": ("openai", "CreateChatCompletionStreamResponse"),
    "completions": ("openai", "CreateCompletionResponse"),
    "responses": ("openai", "ResponseStreamEvent"),
    "anthropic": ("anthropic", "MessageStreamEvent"),
}
# Ollama's newline-delimited JSON streams: (each line's schema, the final answer's schema).
NDJSON_EVENTS = {
    "chat": ("ChatStreamEvent", "ChatResponse"),
    "generate": ("GenerateStreamEvent", "GenerateResponse"),
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


def _openai_gaps(api: str, value: Any) -> Any:
    """`value` as OpenAI's document can read it. A gap in that document: a Response's
    `usage` is not nullable there, but OpenAI's API sends `usage: null` in a response not
    yet finished (response.created, response.in_progress) and its SDK's type is
    Optional; the Open Responses specification requires the key and allows null. So a
    null usage is checked against the specification only."""
    if api != "openai" or not isinstance(value, dict):
        return value
    response = value.get("response", value)
    if not isinstance(response, dict) or "usage" not in response or response["usage"]:
        return value
    response = {k: v for k, v in response.items() if k != "usage"}
    return {**value, "response": response} if "response" in value else response


def _open_responses_gaps(api: str, value: Any) -> Any:
    """`value` as the Open Responses specification can read it. Where it and OpenAI's
    document disagree: a Response's `text.format` of type json_schema echoes the request's
    schema in OpenAI's (required there, `description` an optional string), while the
    specification wants `schema: null` and a `description` (string or null). The door
    echoes OpenAI's way, which its SDK reads; so the echoed schema and description are
    checked against OpenAI's document only."""
    if api != "openresponses" or not isinstance(value, dict):
        return value
    response = value.get("response", value)
    text = response.get("text") if isinstance(response, dict) else None
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict) or response.get("object") != "response":
        return value
    if fmt.get("type") != "json_schema":
        return value
    fmt = {**fmt, "schema": None, "description": fmt.get("description")}
    response = {**response, "text": {**response["text"], "format": fmt}}
    return {**value, "response": response} if "response" in value else response


# Answers that more than one published document describes: a Responses object is OpenAI's
# `Response` and the Open Responses specification's `ResponseResource`; a Messages answer
# is Anthropic's document's and its current SDK's type (validate_sdk).
ALSO = {("openai", "Response"): ("openresponses", "ResponseResource")}


def validate(api: str, name: str, value: Any) -> Any:
    """`value`, if it is valid against schema `name` (and what ALSO and validate_sdk add
    to it); an AssertionError saying how not."""
    found = errors(api, name, _open_responses_gaps(api, _openai_gaps(api, value)))
    assert not found, f"not a valid {api} {name}:\n  " + "\n  ".join(found) + f"\n{value}"
    if (api, name) in ALSO:
        validate(*ALSO[api, name], value)
    if api == "anthropic" and name in ("Message", "CountMessageTokensResponse"):
        validate_sdk(name, value)
    return value


def open_responses_event(data: dict[str, Any]) -> str | None:
    """The Open Responses schema of a stream event of `data`'s type; None for a type the
    specification does not define (OpenAI's `response.reasoning_text.*`: the specification
    names its reasoning events `response.reasoning.*`)."""
    doc = _document("openresponses")
    by_type = {
        doc["components"]["schemas"][name]["properties"]["type"]["enum"][0]: name
        for name in doc["x-stream-events"]
    }
    return by_type.get(data.get("type"))


def validate_open_responses_event(data: dict[str, Any]) -> dict[str, Any]:
    """A Responses stream event checked against the Open Responses specification."""
    name = open_responses_event(data)
    if name is not None:
        validate("openresponses", name, data)
    return data


def _sdk_type(name: str) -> Any:
    import anthropic.types

    return {
        "Message": anthropic.types.Message,
        "MessageStreamEvent": anthropic.types.RawMessageStreamEvent,
        "CountMessageTokensResponse": anthropic.types.MessageTokensCount,
    }[name]


def _all_required(node: Any) -> Any:
    """A pydantic JSON schema read as Anthropic's document reads its response objects:
    every property required, no other key allowed."""
    if isinstance(node, dict):
        node = {k: _all_required(v) for k, v in node.items()}
        if node.get("type") == "object" and "properties" in node:
            node["required"] = sorted(node["properties"])
            node["additionalProperties"] = False
        return node
    if isinstance(node, list):
        return [_all_required(v) for v in node]
    return node


@functools.cache
def _sdk_validator(name: str):
    schema = TypeAdapter(_sdk_type(name)).json_schema(mode="serialization")
    return validators.validator_for(schema)(_all_required(schema))


def validate_sdk(name: str, value: Any) -> Any:
    """`value` checked against the installed anthropic SDK's type for schema `name` of
    anthropic.json (Message, MessageStreamEvent, CountMessageTokensResponse), strictly
    (see the module's docstring); the SDK's pydantic validation too."""
    if name == "MessageStreamEvent" and value.get("type") == "ping":
        return value  # (in Anthropic's streams and document, not among the SDK's types)
    found = []
    for error in _sdk_validator(name).iter_errors(value):
        for leaf in _branch_errors(error):
            path = "/".join(str(p) for p in leaf.absolute_path) or "(top)"
            found.append(f"{path}: {leaf.message[:300]}")
    assert not found, f"not a valid anthropic SDK {name}:\n  " + "\n  ".join(found) + f"\n{value}"
    TypeAdapter(_sdk_type(name)).validate_python(value)
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
        if kind == "responses":
            validate_open_responses_event(data)
        if kind == "anthropic":
            validate_sdk(name, data)
        out.append(data)
    return out


def check_ndjson(kind: str, body: str) -> list[Any]:
    """Every line of an Ollama `kind` stream ("chat" or "generate") validated against
    Ollama's document, the last (`done: true`) also as the final answer; their data."""
    each, final = NDJSON_EVENTS[kind]
    lines = [json.loads(line) for line in body.splitlines() if line.strip()]
    assert lines, "an empty stream"
    for data in lines:
        assert "error" not in data, f"the stream carried an error: {data}"
        validate("ollama", each, data)
    assert [d["done"] for d in lines] == [False] * (len(lines) - 1) + [True], lines
    validate("ollama", final, lines[-1])
    return lines
