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

from jsonschema.exceptions import best_match
from openapi_schema_validator import OAS31Validator

SCHEMAS = Path(__file__).parent / "schemas"
# Each stream's events by the schema that describes them.
STREAM_EVENTS = {
    "chat": ("openai", "CreateChatCompletionStreamResponse"),
    "completions": ("openai", "CreateCompletionResponse"),
    "responses": ("openai", "ResponseStreamEvent"),
    "anthropic": ("anthropic", "MessageStreamEvent"),
}


@functools.cache
def _document(api: str) -> dict[str, Any]:
    return json.loads((SCHEMAS / f"{api}.json").read_text())


@functools.cache
def _validator(api: str, name: str) -> OAS31Validator:
    doc = _document(api)
    if name not in doc["components"]["schemas"]:
        raise KeyError(f"{name} is not among tests/schemas/{api}.json's schemas")
    # `#/components/schemas/...` references resolve against this root.
    schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    return OAS31Validator(schema)


def errors(api: str, name: str, value: Any) -> list[str]:
    """Every way `value` breaks schema `name` of `api`'s document, most specific first."""
    found = []
    for error in _validator(api, name).iter_errors(value):
        # A oneOf/anyOf failure names the branch whose error is most telling.
        deepest = best_match(error.context) if error.context else error
        path = "/".join(str(p) for p in deepest.absolute_path) or "(top)"
        found.append(f"{path}: {deepest.message[:300]}")
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
        out.append(validate(api, name, data))
    return out
