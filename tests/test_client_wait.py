"""Waiting for a cluster: `wait_serving` notices a rank 0 that starts listening late at
once, not after gRPC's reconnect backoff (1 s, growing 1.6x a try) has run out."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mlx_relay.client.client import wait_serving
from mlx_relay.launch.local import free_ports

LATE_S = 4.0  # gRPC's own tries: about 1, 2.6, 5.2 and 9.3 s after the first (between
# its second and third)
NOTICED_S = 1.5  # ours tries every 0.1-0.25 s, and wait_serving asks every 0.2 s


def test_a_server_that_listens_late_is_seen_within_a_moment():
    address = f"127.0.0.1:{free_ports(1)[0]}"
    up: dict[str, object] = {}

    def listen_late() -> None:
        time.sleep(LATE_S)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        servicer = health.HealthServicer()
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        server.add_insecure_port(address)
        server.start()
        up["at"], up["server"] = time.monotonic(), server

    threading.Thread(target=listen_late, daemon=True).start()
    try:
        wait_serving(address, 30)
        seen = time.monotonic()
        assert seen - up["at"] < NOTICED_S, f"seen {seen - up['at']:.2f} s after it listened"
    finally:
        if "server" in up:
            up["server"].stop(0)
