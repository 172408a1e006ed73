"""Pydantic pieces the API schemas share; unknown fields are accepted and ignored,
as clients send many that do not concern a local server (user, store, metadata ...)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict


class Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def sse(data: Any, event: str | None = None) -> str:
    """One server-sent event; `data` is JSON-encoded unless it is already text."""
    body = data if isinstance(data, str) else dumps(data)
    return (f"event: {event}\n" if event else "") + f"data: {body}\n\n"
