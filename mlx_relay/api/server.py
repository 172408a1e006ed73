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
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mlx_relay import proctitle
from mlx_relay.api.auth import TokenAuth, server_credentials
from mlx_relay.api.cluster import Cluster
from mlx_relay.api.config import ServeConfig
from mlx_relay.api.service import SERVICE_NAME, RelayServicer, add_to_server
from mlx_relay.coordinator.engine import Engine
from mlx_relay.coordinator.pipeline import Pipeline, hub_ready
from mlx_relay.protocol.exits import EXIT_CLUSTER_FAILED, EXIT_LOAD_FAILED, report_fatal
from mlx_relay.protocol.rpc import auth_token
from mlx_relay.transport.hub import ControlHub
from mlx_relay.transport.ring import Ring
from mlx_relay.transport.tensor import TensorGroup

log = logging.getLogger("mlx_relay.server")

MAX_RESPONSE_BYTES = 16 * 1024 * 1024
WATCHDOG_INTERVAL_S = 0.1
LOOPBACK = ("127.0.0.1", "localhost", "[::1]", "unix:")


def run(
    config: ServeConfig,
    ring: Ring | None,
    hub: ControlHub | None,
    tensor: TensorGroup | None = None,
) -> int:
    pipeline = Pipeline(
        ring,
        hub,
        heartbeat_timeout=config.heartbeat_timeout,
        step_timeout=config.step_timeout,
        steps_in_flight=config.steps_in_flight,
        tensor=tensor,
        stage_weights=config.stage_weights,
        stage_keep_free=config.stage_keep_free,
        prompt_store=config.prompt_store,
    )
    engine = Engine(pipeline, config.engine)
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
    servers = _grpc_server(config, engine, health_servicer)
    if servers is None:
        return 2

    # SIGTERM/SIGINT received: the first drains and stops, a second stops without
    # waiting for requests. A counter, not Events: a handler runs on the main thread,
    # which may hold the very lock an Event.set would take (it waits on that Event), and
    # the first signal then deadlocked rank 0 (seen when the launcher was killed).
    signals = [0]

    def on_signal(*_: object) -> None:
        signals[0] += 1

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

    if hub is not None:
        try:
            hub_ready(hub, pipeline.world_size, timeout=config.startup_timeout)
        except RuntimeError as e:
            log.error("%s", e)
            engine.error = str(e)
            on_state("failed")
            return _close(servers, hub, EXIT_CLUSTER_FAILED)
        threading.Thread(
            target=watchdog,
            args=(engine, hub, config.heartbeat_timeout),
            name="watchdog",
            daemon=True,
        ).start()
    engine.start()
    if config.model and not _load_at_start(engine, config.model, config.layer_counts):
        if engine.state != "failed":
            return _stop_after_failed_load(engine, servers, hub, config.shutdown_timeout)

    while not signals[0]:
        time.sleep(0.1)
        if not engine.running or engine.state == "failed":
            break
    if engine.state == "failed":
        log.error("exiting with code %d: %s", EXIT_CLUSTER_FAILED, engine.error)
        if hub is not None:
            hub.bye()  # the workers still alive go now instead of waiting for silence
        engine.join(timeout=2)
        return _close(servers, hub, EXIT_CLUSTER_FAILED)
    code = 0
    if engine.running:
        _drain(engine, config.drain_timeout, lambda: signals[0] > 1)
        log.info("stopping: freeing the model and shutting every rank down")
        try:
            engine.free(shutdown=True).result(timeout=config.shutdown_timeout)
        except Exception as e:  # noqa: BLE001
            log.error("clean shutdown failed: %s", e)
            code = EXIT_CLUSTER_FAILED
    engine.join(timeout=5)
    return _close(servers, hub, code)


def _load_at_start(engine: Engine, spec: str, layers: list[int] | str | None) -> bool:
    """Load the model named at start; on failure say why, as this rank's last words."""
    try:
        loaded = engine.load(spec, layers).result()
    except Exception as e:  # noqa: BLE001 - any reason is the user's to read
        engine.error = f"cannot load {spec}: {e}"
        report_fatal(0, engine.error)
        return False
    log.info("serving %s: layers %s", loaded.path, loaded.ranges)
    proctitle.show_layers(*loaded.ranges[0])
    return True


def _stop_after_failed_load(
    engine: Engine, servers: list[grpc.Server], hub: ControlHub | None, timeout: float
) -> int:
    """The model given at start did not load: a start that cannot serve ends at once.

    (A LoadModel call that fails later leaves the cluster up, to load something else.)
    Every worker is shut down cleanly, so rank 0's exit code carries the one cause.
    """
    try:
        engine.free(shutdown=True).result(timeout=timeout)
    except Exception as e:  # noqa: BLE001 - the workers end anyway once rank 0 is silent
        log.warning("shutting the workers down after the failed load: %s", e)
    engine.join(timeout=5)
    return _close(servers, hub, EXIT_LOAD_FAILED)


def _grpc_server(config: ServeConfig, engine: Engine, health_servicer) -> list[grpc.Server] | None:
    """The gRPC front door, and LocalAI's and the HTTP doors beside it when asked for."""
    token = auth_token(config.auth_token)
    threads = max(64, config.engine.max_active + config.engine.max_queue + 16)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grpc"),
        interceptors=[TokenAuth(token)] if token else [],
        options=[
            ("grpc.max_receive_message_length", config.max_request_bytes),
            ("grpc.max_send_message_length", MAX_RESPONSE_BYTES),
            # gRPC sets SO_REUSEPORT by default: a second cluster on the same port would
            # start, and clients would reach one of the two at random. Refuse instead.
            ("grpc.so_reuseport", 0),
        ],
        # Beyond this, RPCs fail at once with RESOURCE_EXHAUSTED instead of queueing
        # for a thread (streams hold one each) where health checks would starve.
        maximum_concurrent_rpcs=threads,
    )
    cluster = Cluster(
        engine,
        backend=config.backend,
        model=config.model,
        layers=config.layers,
        tool_fallback=config.tool_fallback,
    )
    servicer = RelayServicer(cluster)
    add_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = config.grpc_address
    try:
        _listen(server, address, config.tls_cert, config.tls_key)
    except ListenError as e:
        report_fatal(0, str(e))
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
        " with TLS" if config.tls_cert else "",
        ", bearer token required" if token else "",
    )
    servers = [server]
    # (each door's web and proto modules are imported only where it is asked for: a rank
    # 0 that serves gRPC alone starts sooner)
    if config.localai_address:
        from mlx_relay.api import localai

        try:
            servers.append(
                localai.serve(
                    cluster,
                    config.localai_address,
                    token=token,
                    threads=threads,
                    max_request_bytes=config.max_request_bytes,
                )
            )
        except OSError as e:
            server.stop(grace=0)
            report_fatal(0, str(e))
            return None
    if not config.http_address:
        return servers
    from mlx_relay.api.http import server as http_server

    try:
        http = http_server.start(config, cluster)  # stopped by _close like the others
    except http_server.ListenError as e:
        for started in servers:
            started.stop(grace=0)
        report_fatal(0, str(e))
        return None
    if http is not None:
        servers.append(http)
    return servers


class ListenError(Exception):
    """Rank 0 cannot serve gRPC where it was told to."""


def _listen(server: grpc.Server, address: str, cert: str, key: str) -> int:
    """Add the gRPC port, with TLS when a certificate is given; the port, or ListenError."""
    if bool(cert) != bool(key):
        raise ListenError("TLS needs both --tls-cert and --tls-key")
    try:
        credentials = server_credentials(cert, key) if cert else None
    except OSError as e:
        raise ListenError(f"cannot read the TLS certificate or key: {e}") from None
    try:
        if credentials is not None:
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
    except (OSError, RuntimeError):
        port = 0
    if port == 0:
        raise ListenError(
            f"cannot listen on {address}: in use (another cluster? `mlx-relay free --shutdown "
            f"--address {address}` stops it) or not an address of this machine"
        )
    return port


def watchdog(engine: Engine, hub: ControlHub, heartbeat_timeout: float) -> None:
    """Fail the cluster as soon as a worker is gone or silent, or the step the engine
    waits for inside MLX is overdue (--step-timeout), whatever the engine does: its
    thread may be held inside MLX (an eager hop's send to a rank that died, queued
    behind a receive from one that is silent), where only this thread can answer the
    clients. It watches from before the engine's thread starts until that thread ends:
    it used to leave at once where it looked before the start (a loaded machine's main
    thread slow to start the engine), and a rank killed later went unnamed."""
    started = False
    while True:
        time.sleep(WATCHDOG_INTERVAL_S)
        running = engine.running
        started = started or running
        if engine.state == "failed" or (started and not running):
            return
        if engine.state == "stopping":
            continue
        failure = hub.failure(heartbeat_timeout) or engine.pipeline.overdue()
        if failure is not None:
            log.error("watchdog: %s", failure)
            engine.fail(f"cluster failed: {failure}")
            return


def _drain(engine: Engine, timeout: float, hurried: Callable[[], bool]) -> None:
    """Let accepted requests finish (new ones are refused) for up to `timeout` seconds."""
    engine.drain()
    deadline = time.monotonic() + timeout
    active, queued = engine.scheduler.counts()
    if active or queued:
        log.info(
            "draining %d running and %d queued requests (up to %.0f s)", active, queued, timeout
        )
    while (active or queued) and time.monotonic() < deadline and not hurried():
        if not engine.running or engine.state == "failed":
            return
        time.sleep(0.05)
        active, queued = engine.scheduler.counts()
    if active or queued:
        log.warning("drain: %d requests still running; they end with UNAVAILABLE", active + queued)


def _close(servers: list[grpc.Server], hub: ControlHub | None, code: int) -> int:
    """Give answered requests a moment to reach their clients, then let every rank go."""
    for stopped in [server.stop(grace=1) for server in servers]:
        stopped.wait(2)
    if hub is not None:
        hub.bye()
        hub.close()
    return code
