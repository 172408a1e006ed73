"""Rank 0's process: gRPC front door, health, the engine, and a clean way out."""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mlx_relay.coordinator.engine import Engine
from mlx_relay.coordinator.pipeline import Pipeline, hub_ready
from mlx_relay.coordinator.service import SERVICE_NAME, RelayServicer, add_to_server
from mlx_relay.ring import Ring
from mlx_relay.sidechannel import ControlHub

log = logging.getLogger("mlx_relay.server")

EXIT_CLUSTER_FAILED = 3
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def run(args, ring: Ring | None, hub: ControlHub | None) -> int:
    pipeline = Pipeline(
        ring, hub, heartbeat_timeout=args.heartbeat_timeout, step_timeout=args.step_timeout
    )
    engine = Engine(
        pipeline,
        max_active=args.max_active,
        max_queue=args.max_queue,
        prefill_chunk=args.prefill_chunk,
        default_max_tokens=args.default_max_tokens,
    )
    health_servicer = health.HealthServicer()

    def on_state(state: str) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if state == "serving"
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            health_servicer.set(name, status)

    on_state("starting")
    engine.on_state = on_state
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="grpc"),
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    servicer = RelayServicer(engine, backend=args.backend)
    add_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if server.add_insecure_port(args.grpc_address) == 0:
        log.error("cannot listen on %s", args.grpc_address)
        return 2
    server.start()
    log.info("gRPC listening on %s", args.grpc_address)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    if hub is not None:
        hub_ready(hub, pipeline.world_size, timeout=args.startup_timeout)
    engine.start()
    if args.model:
        layers = args.layer_counts
        load = engine.load(args.model, layers)
        try:
            loaded = load.result()
            log.info("serving %s: layers %s", loaded.path, loaded.ranges)
        except Exception as e:  # noqa: BLE001 - stay up so a client can load again
            engine.error = f"load failed: {e}"
            log.error("loading %s failed: %s", args.model, e)

    while not stop.wait(0.2):
        if not engine.running:
            break
    code = 0
    if engine.state == "failed":
        code = EXIT_CLUSTER_FAILED
    elif engine.running:
        log.info("stopping: freeing the model and shutting every rank down")
        try:
            engine.free(shutdown=True).result(timeout=args.shutdown_timeout)
        except Exception as e:  # noqa: BLE001
            log.error("clean shutdown failed: %s", e)
            code = EXIT_CLUSTER_FAILED
    engine.join(timeout=5)
    server.stop(grace=1).wait(2)
    if hub is not None:
        hub.bye()
        hub.close()
    return code
