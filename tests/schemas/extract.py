"""Cut the parts these tests validate against out of the API owners' OpenAPI documents.

The published documents are large (OpenAI's is 3 MB, Anthropic's 1.6 MB) and describe
hundreds of endpoints this server does not have; the tests need only the response and
stream-event schemas of the endpoints it serves. This keeps those schemas and every
schema they reference, byte for byte as published (only `description` and `example`
texts are dropped, which validation does not read), plus where they came from:

    python tests/schemas/extract.py openai FULL.json SOURCE > tests/schemas/openai.json
    python tests/schemas/extract.py anthropic FULL.json SOURCE > tests/schemas/anthropic.json
    python tests/schemas/extract.py openresponses FULL.json SOURCE > tests/schemas/openresponses.json
    python tests/schemas/extract.py ollama FULL.json SOURCE > tests/schemas/ollama.json

FULL.json is the whole document (YAML converted to JSON if need be), SOURCE a line
saying where it came from (repository and commit); see NOTICE beside this file.
"""

from __future__ import annotations

import json
import sys
from typing import Any

ROOTS = {
    "openai": [
        "CreateChatCompletionResponse",
        "CreateChatCompletionStreamResponse",
        "CreateCompletionResponse",
        "Response",
        "ResponseStreamEvent",
        "ListModelsResponse",
        "Model",
        "ErrorResponse",
    ],
    "anthropic": [
        "Message",
        "MessageStreamEvent",
        "CountMessageTokensResponse",
        "ErrorResponse",
    ],
    # The Open Responses document names no union of its stream events: they are the
    # `text/event-stream` oneOf of POST /responses (STREAMS), added to these.
    "openresponses": ["ResponseResource", "Error"],
    "ollama": [
        "GenerateResponse",
        "GenerateStreamEvent",
        "ChatResponse",
        "ChatStreamEvent",
        "ListResponse",
        "PsResponse",
        "ShowResponse",
        "VersionResponse",
        "ErrorResponse",
    ],
}
# Where a document lists its stream's events: (path, method) of the streaming operation.
STREAMS = {"openresponses": ("/responses", "post")}
PREFIX = "#/components/schemas/"
DROPPED = ("description", "example", "examples", "x-oaiMeta", "x-stainless-naming")


def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"][len(PREFIX) :]} if isinstance(node.get("$ref"), str) else set()
        if "mapping" in node and isinstance(node["mapping"], dict):
            found |= {v[len(PREFIX) :] for v in node["mapping"].values() if isinstance(v, str)}
        for value in node.values():
            found |= _refs(value)
        return found
    if isinstance(node, list):
        return set().union(*map(_refs, node)) if node else set()
    return set()


def _strip(node: Any, in_properties: bool = False) -> Any:
    """Without documentation texts (a property that is *named* `description` stays)."""
    if isinstance(node, dict):
        return {
            k: _strip(v, k == "properties")
            for k, v in node.items()
            if in_properties or k not in DROPPED
        }
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def extract(doc: dict[str, Any], roots: list[str]) -> dict[str, dict[str, Any]]:
    schemas = doc["components"]["schemas"]
    kept: dict[str, Any] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in kept:
            continue
        kept[name] = schemas[name]
        todo += sorted(_refs(schemas[name]) - kept.keys())
    return {name: _strip(kept[name]) for name in sorted(kept)}


def stream_events(doc: dict[str, Any], api: str) -> list[str]:
    """The schemas of the events the document's streaming operation sends, in its order."""
    if api not in STREAMS:
        return []
    path, method = STREAMS[api]
    content = doc["paths"][path][method]["responses"]["200"]["content"]
    return [ref["$ref"][len(PREFIX) :] for ref in content["text/event-stream"]["schema"]["oneOf"]]


def main() -> None:
    api, path, source = sys.argv[1:4]
    doc = json.load(open(path))
    events = stream_events(doc, api)
    out = {
        "openapi": doc["openapi"],
        "info": {"title": doc["info"].get("title", api), "x-source": source},
        "x-roots": ROOTS[api] + events,
        **({"x-stream-events": events} if events else {}),
        "components": {"schemas": extract(doc, ROOTS[api] + events)},
    }
    json.dump(out, sys.stdout, indent=1, sort_keys=True, ensure_ascii=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
