"""The HTTP doors wired into one ASGI app: routes, errors in each API's shape, auth, limits.

Errors are rendered by the API the path belongs to (Anthropic's under /v1/messages,
Ollama's under /api/, OpenAI's elsewhere), with the HTTP status matching the gRPC status
the same error gets from the gRPC door. The bearer token is the gRPC door's; Anthropic's
SDK may send it as `x-api-key` instead.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from mlx_relay.api.cluster import REFUSALS, Cluster
from mlx_relay.api.http import anthropic, live, ollama, openai, ops, responses
from mlx_relay.api.http.common import Door, HttpError, as_http_error

log = logging.getLogger("mlx_relay.http")


def error_response(path: str, e: HttpError) -> JSONResponse:
    if path.startswith("/v1/messages"):
        body = anthropic.error_body(e)
    elif path.startswith("/api/"):
        body = ollama.error_body(e)
    else:
        body = openai.error_body(e)
    return JSONResponse(body, status_code=e.status)


def _validation_message(e: RequestValidationError) -> tuple[str, str | None]:
    """Pydantic's first complaint as one sentence naming the field."""
    errors = e.errors()
    if not errors:
        return "the request body is invalid", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}", None
    field = ".".join(loc) or None
    if field is None and first.get("type") in ("model_attributes_type", "dict_type"):
        return "the request body must be a JSON object (Content-Type: application/json)", None
    problems = []
    for error in errors[:3]:
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
        problems.append(f"{where}: {error.get('msg', 'invalid')}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "; ".join(problems) + more, field


def create_app(cluster: Cluster, *, token: str = "", max_body_bytes: int = 4 << 20) -> ASGIApp:
    """The app rank 0 serves; `token` '' lets anyone in (loopback only, by default)."""
    door = Door(cluster)
    app = FastAPI(title="mlx-relay", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.door = door
    # (live first: its `GET /` serves browsers the page, and others what Ollama's did)
    for module in (live, openai, responses, anthropic, ollama, ops):
        app.include_router(module.router(door))

    @app.exception_handler(HttpError)
    async def http_error(request: Request, e: HttpError) -> JSONResponse:
        return error_response(request.url.path, e)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        message, field = _validation_message(e)
        return error_response(request.url.path, HttpError("invalid", message, field))

    @app.exception_handler(StarletteHTTPException)
    async def starlette_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = {404: "no_route", 405: "no_route", 413: "too_large"}.get(e.status_code, "invalid")
        detail = str(e.detail)
        if kind == "no_route":  # OpenAI's words for it; no model is missing
            detail = f"Invalid URL ({request.method} {request.url.path}): {detail}"
        error = HttpError(kind, detail)
        response = error_response(request.url.path, error)
        response.status_code = e.status_code
        return response

    async def engine_error(request: Request, e: Exception) -> JSONResponse:
        error = as_http_error(e)
        if error.kind == "internal":
            log.exception("%s failed", request.url.path, exc_info=e)
        return error_response(request.url.path, error)

    # The engine's refusals by class (Starlette re-raises, and so logs, what only the
    # catch-all `Exception` handler answers); the catch-all for real failures.
    for kind in (*REFUSALS, Exception):
        app.add_exception_handler(kind, engine_error)
    return Guard(app, token, max_body_bytes)


# Open without the token: liveness probes and Prometheus scrapers usually carry none, and
# neither path shows a prompt or takes a request (RELIABILITY.md, README).
OPEN_PATHS = ("/health", "/metrics")
# A body sent as one of these is read as JSON all the same: `curl -d` (Ollama's own
# examples) sends form-urlencoded, some clients no Content-Type at all.
JSON_BY_DEFAULT = (b"", b"application/x-www-form-urlencoded", b"text/plain")


class Guard:
    """Bearer token and body size, checked before a request reaches any route; a body
    without a JSON Content-Type is taken as JSON (every route reads JSON)."""

    def __init__(self, app: ASGIApp, token: str, max_body_bytes: int) -> None:
        self.app = app
        self.token = token.encode()
        self.max_body_bytes = max_body_bytes
        self.refused = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        path = scope.get("path", "")
        # (the live page itself is open, so that it can ask for the token it then sends)
        open_page = (
            path == live.PAGE_PATH
            and scope.get("method") in ("GET", "HEAD")
            and live.wants_page(headers.get("accept", b"").decode("latin-1"))
        )
        if (
            self.token
            and path not in OPEN_PATHS
            and not open_page
            and not self._authorized(headers)
        ):
            self.refused += 1
            if self.refused == 1 or self.refused % 100 == 0:
                log.warning("refused %s: no or wrong bearer token (%d so far)", path, self.refused)
            error = HttpError(
                "unauthenticated",
                "this server requires `Authorization: Bearer <token>` (the cluster's token)",
            )
            return await error_response(path, error)(scope, receive, send)
        length = headers.get("content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            error = HttpError(
                "too_large",
                f"the request body is {int(length)} bytes; this server takes at most "
                f"{self.max_body_bytes} (--max-request-bytes)",
            )
            return await error_response(path, error)(scope, receive, send)
        kind = headers.get("content-type", b"").split(b";")[0].strip().lower()
        if scope.get("method") == "POST" and kind in JSON_BY_DEFAULT:
            raw = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
            scope = {**scope, "headers": [*raw, (b"content-type", b"application/json")]}
        await self.app(scope, self._limited(receive), send)

    def _authorized(self, headers: dict[str, bytes]) -> bool:
        presented = headers.get("authorization", b"")
        if presented[:7].lower() == b"bearer ":
            presented = presented[7:]
        else:
            presented = headers.get("x-api-key", b"")
        return bool(presented) and hmac.compare_digest(presented.strip(), self.token)

    def _limited(self, receive: Receive) -> Receive:
        """A body sent without a length is cut off at the limit too."""
        seen = 0

        async def limited() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body_bytes:
                raise StarletteHTTPException(
                    413, f"the request body exceeds {self.max_body_bytes} bytes"
                )
            return message

        return limited
