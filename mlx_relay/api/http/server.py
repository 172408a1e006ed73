"""The HTTP doors' server: uvicorn in a thread of rank 0's process, beside gRPC.

The socket is bound here, before the thread starts, so an address in use is reported
the way gRPC's is (rank 0 does not start) rather than lost in a thread.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

import uvicorn
from starlette.types import ASGIApp

from mlx_relay.transport.droplog import DropLog, JunkFilter

log = logging.getLogger("mlx_relay.http")

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class ListenError(Exception):
    """Rank 0 cannot serve HTTP where it was told to."""


def parse_address(address: str) -> tuple[str, int]:
    """'HOST:PORT', '[v6]:PORT' or a bare 'PORT' (loopback)."""
    host, sep, port = address.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", address
    host = host.strip("[]") or "0.0.0.0"
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ListenError(f"--http-address {address!r} is not HOST:PORT")
    return host, int(port)


class HttpServer:
    """An ASGI app served on `address` until `stop`."""

    def __init__(self, app: ASGIApp, address: str, cert: str = "", key: str = "") -> None:
        host, port = parse_address(address)
        if bool(cert) != bool(key):
            raise ListenError("TLS needs both --tls-cert and --tls-key")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self.socket = socket.create_server((host, port), family=family, backlog=512)
        except OSError as e:
            raise ListenError(
                f"cannot listen for HTTP on {address}: {os.strerror(e.errno) if e.errno else e} (in use by another "
                "cluster or program, or not an address of this machine)"
            ) from None
        self.host = host
        self.port = self.socket.getsockname()[1]
        self.tls = bool(cert)
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            ssl_certfile=cert or None,
            ssl_keyfile=key or None,
            timeout_graceful_shutdown=1,
            ws="none",
        )
        try:
            config.load()
        except (OSError, ValueError) as e:
            self.socket.close()
            raise ListenError(f"cannot read the TLS certificate or key: {e}") from None
        self.server = uvicorn.Server(config)
        # Junk on the port: a few lines a window, not a warning per connection.
        junk = JunkFilter(DropLog(log, "HTTP door"), "its clients", ("Invalid HTTP request",))
        logging.getLogger("uvicorn.error").addFilter(junk)
        self.thread = threading.Thread(target=self._run, name="http", daemon=True)

    @property
    def loopback_only(self) -> bool:
        return self.host in LOOPBACK

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.socket])
        except BaseException:  # noqa: BLE001 - the thread's end is the server's end
            log.exception("the HTTP server stopped")

    def start(self) -> None:
        self.thread.start()

    def stop(self, grace: float = 1.0) -> threading.Event:
        """Close the listener and end open streams after `grace` seconds; like
        `grpc.Server.stop`, returns at once with an event set once the server is down."""
        # Idle keep-alive connections make uvicorn report an exceeded grace as an ERROR
        # ("Cancel 0 running task(s)"): at shutdown that is noise, not news.
        logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)
        self.server.should_exit = True
        done = threading.Event()

        def finish() -> None:
            self.thread.join(grace + 1)
            if self.thread.is_alive():
                self.server.force_exit = True
                self.thread.join(2)
            self.socket.close()
            done.set()

        if self.thread.is_alive():
            threading.Thread(target=finish, name="http-stop", daemon=True).start()
        else:
            self.socket.close()
            done.set()
        return done


def start(args, cluster) -> HttpServer | None:
    """Rank 0's HTTP doors as the serve options say (None when --http-address is empty).

    Same bearer token and TLS files as gRPC, and the same warning when other machines
    can reach it without a token. Raises ListenError when it cannot listen.
    """
    from mlx_relay.api.http.app import create_app
    from mlx_relay.protocol.rpc import auth_token

    address = getattr(args, "http_address", "") or ""
    if not address:
        return None
    token = auth_token(args.auth_token)
    app = create_app(cluster, token=token, max_body_bytes=args.max_request_bytes)
    server = HttpServer(app, address, args.tls_cert, args.tls_key)
    if not server.loopback_only and not token:
        log.warning(
            "HTTP on %s is reachable from other machines and needs no token: "
            "set MLX_RELAY_AUTH_TOKEN (or --auth-token) and consider --tls-cert/--tls-key",
            address,
        )
    server.start()
    scheme = "https" if server.tls else "http"
    log.info(
        "HTTP listening on %s://%s:%d (OpenAI /v1, Anthropic /v1/messages, Ollama /api)%s",
        scheme,
        server.host,
        server.port,
        ", bearer token required" if token else "",
    )
    return server
