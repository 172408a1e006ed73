"""The client's end of the gRPC port: TLS when asked for, the bearer token on every call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc

from mlx_relay.protocol import rpc


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Client side: add the token to every call, on plain or TLS channels alike."""

    def __init__(self, token: str) -> None:
        self._metadata = (rpc.HEADER, f"Bearer {token}")

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
