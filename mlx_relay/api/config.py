"""Rank 0's serving configuration, frozen: what `mlx-relay serve` was told, built once
from its command line (launch/serve.py's `serve_config`) and passed down to the doors,
the engine (`engine`) and the pipeline. Nothing below reads the command line."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlx_relay.coordinator.config import EngineConfig
from mlx_relay.protocol.rpc import DEFAULT_GRPC_ADDRESS


@dataclass(frozen=True)
class ServeConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    # The model loaded at start (--model; '' none) and its split (--layers, as given;
    # `layer_counts`: as checked, or "auto" once every rank said hello).
    model: str = ""
    layers: str = ""
    layer_counts: list[int] | str | None = None
    backend: str = "any"  # --backend
    # The doors: gRPC always, LocalAI's backend service and HTTP where given.
    grpc_address: str = DEFAULT_GRPC_ADDRESS
    localai_address: str = ""
    http_address: str = ""
    auth_token: str | None = None  # --auth-token (else $MLX_RELAY_AUTH_TOKEN)
    tls_cert: str = ""
    tls_key: str = ""
    max_request_bytes: int = 4 * 1024 * 1024
    tool_fallback: bool = True  # not --no-tool-fallback
    # The ring's watch (the pipeline's): silence and step deadlines, steps in flight.
    heartbeat_timeout: float = 3.0
    step_timeout: float = 30.0
    steps_in_flight: int = 0
    # --stage-weights: rank 0 ships each worker its shard (coordinator/staging.py)
    stage_weights: bool = False
    stage_keep_free: int = 1_000_000_000
    # --prompt-cache-dir: {"dir", "budget"} of every rank's prompt blocks (prefix_store.py)
    prompt_store: dict[str, Any] | None = None
    # The process: how long the workers may take to say hello, draining, stopping.
    startup_timeout: float = 120.0
    drain_timeout: float = 30.0
    shutdown_timeout: float = 30.0
