"""Who may talk to rank 0: bearer tokens on every RPC, and TLS credentials.

The token is compared in constant time before the request is even deserialized, so a
caller without it learns nothing and costs next to nothing. It should come from the
environment (`MLX_RELAY_AUTH_TOKEN`) rather than the command line, where `ps` shows it.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger("mlx_relay.auth")

AUTH_TOKEN_ENV = "MLX_RELAY_AUTH_TOKEN"
_HEADER = "authorization"
_SCHEME = "bearer "


def auth_token(explicit: str | None = None) -> str:
    """The token from an option if given, else from the environment ('' = no auth)."""
    return explicit if explicit else os.environ.get(AUTH_TOKEN_ENV, "")


def _presented(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == _HEADER:
            if isinstance(value, bytes):
                value = value.decode("latin-1")
            return value[len(_SCHEME) :] if value.lower().startswith(_SCHEME) else ""
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


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Client side: add the token to every call, on plain or TLS channels alike."""

    def __init__(self, token: str) -> None:
        self._metadata = (_HEADER, f"Bearer {token}")

    def _details(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), self._metadata]
        return details._replace(metadata=metadata)

    def intercept_unary_unary(self, continuation, details, request):  # noqa: ANN001
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # noqa: ANN001
        return continuation(self._details(details), request)


def client_channel(
    address: str,
    *,
    token: str = "",
    tls_ca: str | Path | bytes | None = None,
    options: list[tuple[str, Any]] | None = None,
) -> grpc.Channel:
    """A channel to rank 0: TLS when `tls_ca` (PEM path or bytes) is given, token if set.

    `tls_ca=b""` trusts the system's root certificates.
    """
    if tls_ca is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        roots = tls_ca if isinstance(tls_ca, bytes) else Path(tls_ca).read_bytes()
        creds = grpc.ssl_channel_credentials(root_certificates=roots or None)
        channel = grpc.secure_channel(address, creds, options=options)
    if token:
        channel = grpc.intercept_channel(channel, _BearerToken(token))
    return channel
