"""Waiting for a cluster: `wait_serving` notices a rank 0 that starts listening late at
once, not after gRPC's reconnect backoff (1 s, growing 1.6x a try) has run out."""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mlx_relay.client.client import wait_serving
from mlx_relay.launch.local import free_ports

# The server listens right after the client's 4th connection attempt: with gRPC's own
# backoff (tries about 1, 1.6, 2.56 and 4.1 s apart, each +-20%) its next try would come
# 3.3 s later at the soonest, whenever the 4th came; ours tries every 0.1-0.25 s (and
# wait_serving asks every 0.2 s), so the four come within a second and the fifth soon.
# (A fixed late start cannot tell them apart: gRPC's jittered tries land anywhere.)
ATTEMPTS = 4
NOTICED_S = 1.5  # half of gRPC's shortest wait after the 4th try; ours is ~0.3 s


def _count_attempts(raw: socket.socket, attempts: int, deadline: float) -> None:
    """Accept and close connections on `raw` until `attempts` of them were gRPC's (they
    open with HTTP/2's preface; a TLS probe of `Client.explain` opens with a handshake)."""
    seen = 0
    while seen < attempts:
        assert time.monotonic() < deadline, f"{seen} connection attempts in 60 s"
        raw.settimeout(max(0.1, deadline - time.monotonic()))
        conn, _ = raw.accept()
        with conn:
            conn.settimeout(5)
            try:
                seen += conn.recv(3) == b"PRI"
            except OSError:
                pass


def test_a_server_that_listens_late_is_seen_within_a_moment():
    port = free_ports(1)[0]
    address = f"127.0.0.1:{port}"
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    raw.bind(("127.0.0.1", port))
    raw.listen(8)
    up: dict[str, object] = {}

    def listen_late() -> None:
        try:
            _count_attempts(raw, ATTEMPTS, time.monotonic() + 60)
        finally:
            raw.close()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        servicer = health.HealthServicer()
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        server.add_insecure_port(address)
        server.start()
        up["at"], up["server"] = time.monotonic(), server

    listener = threading.Thread(target=listen_late, daemon=True)
    listener.start()
    try:
        wait_serving(address, 60)
        seen = time.monotonic()
        assert "at" in up, "served before the late server listened"
        assert seen - up["at"] < NOTICED_S, f"seen {seen - up['at']:.2f} s after it listened"
        print(f"\nseen {seen - up['at']:.2f} s after it listened")
    finally:
        listener.join(60)
        if "server" in up:
            up["server"].stop(0)
