"""Rank 0's process: gRPC front door, health, the engine, a watchdog, and a clean way out.

The watchdog thread turns a worker that is gone or silent into a clean failure even
while the engine thread is blocked in a collective: every request ends with
UNAVAILABLE naming the rank, health turns NOT_SERVING, the workers are told to go, and
the process exits EXIT_CLUSTER_FAILED so that a supervisor can restart the cluster.
SIGTERM drains instead: new requests are refused, running ones get `--drain-timeout`
to finish, then every rank shuts down and exits 0.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mlx_relay.coordinator.auth import TokenAuth, auth_token, server_credentials
from mlx_relay.coordinator.engine import Engine
from mlx_relay.coordinator.pipeline import Pipeline, hub_ready
from mlx_relay.coordinator.service import SERVICE_NAME, RelayServicer, add_to_server
from mlx_relay.launch.supervise import EXIT_CLUSTER_FAILED
from mlx_relay.ring import Ring
from mlx_relay.sidechannel import ControlHub

log = logging.getLogger("mlx_relay.server")

MAX_RESPONSE_BYTES = 16 * 1024 * 1024
WATCHDOG_INTERVAL_S = 0.1
LOOPBACK = ("127.0.0.1", "localhost", "[::1]", "unix:")


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
        prompt_cache=not args.no_prompt_cache,
        prompt_cache_tokens=args.prompt_cache_tokens,
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
    server = _grpc_server(args, engine, health_servicer)
    if server is None:
        return 2

    stop = threading.Event()  # first SIGTERM/SIGINT: drain and stop
    hurry = threading.Event()  # second one: stop without waiting for requests

    def on_signal(*_: object) -> None:
        (hurry if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

    if hub is not None:
        try:
            hub_ready(hub, pipeline.world_size, timeout=args.startup_timeout)
        except RuntimeError as e:
            log.error("%s", e)
            engine.error = str(e)
            on_state("failed")
            return _close(server, hub, EXIT_CLUSTER_FAILED)
        threading.Thread(
            target=_watchdog,
            args=(engine, hub, args.heartbeat_timeout),
            name="watchdog",
            daemon=True,
        ).start()
    engine.start()
    if args.model:
        load = engine.load(args.model, args.layer_counts)
        try:
            loaded = load.result()
            log.info("serving %s: layers %s", loaded.path, loaded.ranges)
        except Exception as e:  # noqa: BLE001 - stay up so a client can load again
            engine.error = f"load failed: {e}"
            log.error("loading %s failed: %s", args.model, e)

    while not stop.wait(0.1):
        if not engine.running or engine.state == "failed":
            break
    if engine.state == "failed":
        log.error("exiting with code %d: %s", EXIT_CLUSTER_FAILED, engine.error)
        if hub is not None:
            hub.bye()  # the workers still alive go now instead of waiting for silence
        engine.join(timeout=2)
        return _close(server, hub, EXIT_CLUSTER_FAILED)
    code = 0
    if engine.running:
        _drain(engine, args.drain_timeout, hurry)
        log.info("stopping: freeing the model and shutting every rank down")
        try:
            engine.free(shutdown=True).result(timeout=args.shutdown_timeout)
        except Exception as e:  # noqa: BLE001
            log.error("clean shutdown failed: %s", e)
            code = EXIT_CLUSTER_FAILED
    engine.join(timeout=5)
    return _close(server, hub, code)


def _grpc_server(args, engine: Engine, health_servicer) -> grpc.Server | None:
    token = auth_token(args.auth_token)
    threads = max(64, args.max_active + args.max_queue + 16)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grpc"),
        interceptors=[TokenAuth(token)] if token else [],
        options=[
            ("grpc.max_receive_message_length", args.max_request_bytes),
            ("grpc.max_send_message_length", MAX_RESPONSE_BYTES),
        ],
        # Beyond this, RPCs fail at once with RESOURCE_EXHAUSTED instead of queueing
        # for a thread (streams hold one each) where health checks would starve.
        maximum_concurrent_rpcs=threads,
    )
    add_to_server(RelayServicer(engine, backend=args.backend), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = args.grpc_address
    if bool(args.tls_cert) != bool(args.tls_key):
        log.error("TLS needs both --tls-cert and --tls-key")
        return None
    try:
        if args.tls_cert:
            port = server.add_secure_port(address, server_credentials(args.tls_cert, args.tls_key))
        else:
            port = server.add_insecure_port(address)
    except (OSError, RuntimeError) as e:
        log.error("cannot listen on %s: %s", address, e)
        return None
    if port == 0:
        log.error("cannot listen on %s", address)
        return None
    if not address.startswith(LOOPBACK) and not token:
        log.warning(
            "gRPC on %s is reachable from other machines and needs no token: "
            "set MLX_RELAY_AUTH_TOKEN (or --auth-token) and consider --tls-cert/--tls-key",
            address,
        )
    server.start()
    log.info(
        "gRPC listening on %s%s%s",
        address,
        " with TLS" if args.tls_cert else "",
        ", bearer token required" if token else "",
    )
    return server


def _watchdog(engine: Engine, hub: ControlHub, heartbeat_timeout: float) -> None:
    """Fail the cluster as soon as a worker is gone or silent, or the step the engine
    waits for inside MLX is overdue (--step-timeout), whatever the engine does."""
    while True:
        time.sleep(WATCHDOG_INTERVAL_S)
        if engine.state == "failed" or not engine.running:
            return
        if engine.state == "stopping":
            continue
        failure = hub.failure(heartbeat_timeout) or engine.pipeline.overdue()
        if failure is not None:
            log.error("watchdog: %s", failure)
            engine.fail(f"cluster failed: {failure}")
            return


def _drain(engine: Engine, timeout: float, hurry: threading.Event) -> None:
    """Let accepted requests finish (new ones are refused) for up to `timeout` seconds."""
    engine.drain()
    deadline = time.monotonic() + timeout
    active, queued = engine.counts()
    if active or queued:
        log.info(
            "draining %d running and %d queued requests (up to %.0f s)", active, queued, timeout
        )
    while (active or queued) and time.monotonic() < deadline and not hurry.is_set():
        if not engine.running or engine.state == "failed":
            return
        hurry.wait(0.05)
        active, queued = engine.counts()
    if active or queued:
        log.warning("drain: %d requests still running; they end with UNAVAILABLE", active + queued)


def _close(server: grpc.Server, hub: ControlHub | None, code: int) -> int:
    """Give answered requests a moment to reach their clients, then let every rank go."""
    server.stop(grace=1).wait(2)
    if hub is not None:
        hub.bye()
        hub.close()
    return code
