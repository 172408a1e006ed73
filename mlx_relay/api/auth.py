"""Who may talk to rank 0: bearer tokens on every RPC, and TLS credentials (server side;
the client's side is `client.channel`, the token's format `protocol.rpc`).

The token is compared in constant time before the request is even deserialized, so a
caller without it learns nothing and costs next to nothing.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from mlx_relay.protocol import rpc

log = logging.getLogger("mlx_relay.auth")


def _presented(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == rpc.HEADER:
            if isinstance(value, bytes):
                value = value.decode("latin-1")
            return value[len(rpc.SCHEME) :] if value.lower().startswith(rpc.SCHEME) else ""
    return None


class TokenAuth(grpc.ServerInterceptor):
    """Refuse every RPC that does not carry `authorization: Bearer <token>`."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()
        self.refused = 0

    def intercept_service(self, continuation: Callable, details: Any) -> Any:
        handler = continuation(details)
        presented = _presented(details.invocation_metadata)
        if handler is None or (
            presented is not None and hmac.compare_digest(presented.encode(), self._token)
        ):
            return handler
        self.refused += 1
        why = "no bearer token" if presented is None else "wrong bearer token"
        if self.refused == 1 or self.refused % 100 == 0:
            log.warning("refused %s: %s (%d refused so far)", details.method, why, self.refused)
        return _deny(handler, f"{why}: this server requires `authorization: Bearer <token>`")


def _deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape that refuses without reading the request."""

    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    def refuse_stream(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - abort raises

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse_stream)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse)
    return grpc.stream_stream_rpc_method_handler(refuse_stream)


def server_credentials(cert: str | Path, key: str | Path) -> grpc.ServerCredentials:
    """TLS for the gRPC port from PEM files (certificate chain and private key)."""
    return grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())])
