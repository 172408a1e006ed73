"""A small Python client for a cluster's gRPC front door.

gRPC reports every connection problem as UNAVAILABLE with C-core's wording ("failed to
connect to all addresses; ... Socket closed"). `Client.explain` turns that, and a refused
token, into what a person can act on: nothing listening, TLS expected or not, a
certificate not trusted, a token missing or wrong.
"""

from __future__ import annotations

import json
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mlx_relay.client.channel import client_channel
from mlx_relay.errors import CommandFailed
from mlx_relay.protocol import relay_pb2 as pb
from mlx_relay.protocol import relay_pb2_grpc as pb_grpc
from mlx_relay.protocol.rpc import AUTH_TOKEN_ENV, auth_token

# While waiting for a cluster to come up, try to connect again every 0.1-0.25 s. gRPC's
# default backoff (1 s, growing 1.6x a try) lets a rank 0 that started listening wait
# up to 4 s more, after 6 s of imports and loading, before anyone notices it serves.
PROMPT_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 250),
]


class Readiness(NamedTuple):
    serving: bool
    answered: bool  # rank 0 answered (it is up, if not serving yet)
    seen: str  # what stands in the way, in words


class Client:
    """`token` None reads MLX_RELAY_AUTH_TOKEN; `tls_ca` (PEM path or bytes) turns TLS on."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = None,
        token: str | None = None,
        tls_ca: str | bytes | None = None,
        options: list[tuple[str, Any]] | None = None,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.token = auth_token(token)
        self.tls = tls_ca is not None
        self.channel = client_channel(address, token=self.token, tls_ca=tls_ca, options=options)
        self.stub = pb_grpc.RelayStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, request: pb.GenerateRequest) -> pb.GenerateResponse:
        return self.stub.Generate(request, timeout=self.timeout)

    def stream(self, request: pb.GenerateRequest) -> Iterator[pb.GenerateChunk]:
        return self.stub.GenerateStream(request, timeout=self.timeout)

    def status(self) -> pb.StatusResponse:
        return self.stub.Status(pb.StatusRequest(), timeout=self.timeout or 10)

    def serving(self) -> bool:
        try:
            reply = self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def explain(self, error: grpc.RpcError) -> str:
        """What a failed call means, in one line that says what to do about it."""
        return self.diagnose(error)[0]

    def diagnose(self, error: grpc.RpcError) -> tuple[str, bool]:
        """(explanation, final): final when trying again cannot help (token, TLS)."""
        code, details = error.code(), error.details() or ""
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return self._token_problem(), True
        if code == grpc.StatusCode.UNAVAILABLE:
            problem = self._connection_problem(details)
            if problem:
                return problem
        return f"{code.name}: {details}", False

    def _token_problem(self) -> str:
        if not self.token:
            return (
                f"the cluster at {self.address} requires a bearer token: set "
                f"{AUTH_TOKEN_ENV} (or --auth-token) to the cluster's"
            )
        return (
            f"the cluster at {self.address} refused the bearer token: {AUTH_TOKEN_ENV} "
            "(or --auth-token) is not the cluster's"
        )

    def _connection_problem(self, details: str) -> tuple[str, bool] | None:
        """Why the connection failed, when C-core's details say (or a probe tells)."""
        if "Connection refused" in details:
            return (
                f"nothing is listening at {self.address}: is the cluster running? "
                "(`mlx-relay local` starts one; --address says where to look)"
            ), False
        if "CERTIFICATE_VERIFY_FAILED" in details:
            return (
                f"the TLS certificate of {self.address} is not one --tls-ca trusts: give the "
                "certificate the cluster serves (its --tls-cert)"
            ), True
        if "WRONG_VERSION_NUMBER" in details:
            return f"{self.address} does not serve TLS: leave out --tls-ca", True
        if not self.tls and "Socket closed" in details and speaks_tls(self.address):
            return (
                f"{self.address} serves TLS: pass --tls-ca with the certificate it serves "
                "(the cluster's --tls-cert)"
            ), True
        if "DNS resolution failed" in details:
            return f"cannot resolve the host in {self.address}", False
        if "Deadline Exceeded" in details or "Timeout occurred" in details:
            return f"no answer from {self.address} (a firewall, or the wrong host?)", False
        return None

    def readiness(self) -> Readiness:
        """Where the cluster is on its way to SERVING; raises CommandFailed when waiting
        cannot help: a token or TLS mismatch, or a cluster that failed."""
        try:
            reply = self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
        except grpc.RpcError as e:
            why, final = self.diagnose(e)
            if final:
                raise CommandFailed(why) from None
            return Readiness(False, False, why)
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            return Readiness(True, True, "serving")
        try:
            status = self.stub.Status(pb.StatusRequest(), timeout=2)
        except grpc.RpcError as e:
            return Readiness(False, True, self.explain(e))
        if status.state == "failed":
            raise CommandFailed(f"the cluster at {self.address} failed: {status.error}")
        if status.state == "unloaded" and status.error:  # the model given at start
            raise CommandFailed(f"the cluster at {self.address} failed to start: {status.error}")
        if status.state == "unloaded":
            return Readiness(False, True, "it is up but serves no model (`mlx-relay load`)")
        error = f": {status.error}" if status.error else ""
        return Readiness(False, True, f"it is up, {status.state}{error}")


class NotServing(CommandFailed, TimeoutError):
    """The cluster did not come to serve in the time given."""


def speaks_tls(address: str, timeout: float = 2.0) -> bool:
    """Whether the server at `host:port` completes a TLS handshake (certificate unchecked)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        with (
            socket.create_connection((host, int(port)), timeout=timeout) as raw,
            context.wrap_socket(raw, server_hostname=host),
        ):
            return True
    except (OSError, ValueError):
        return False


def wait_serving(
    address: str,
    timeout: float,
    *,
    check: Callable[[], None] | None = None,
    token: str | None = None,
    tls_ca: str | bytes | None = None,
) -> None:
    """Block until the cluster at `address` reports SERVING; `check` may raise to give up.

    Gives up at once, with the reason (CommandFailed), when waiting cannot help: the
    token or TLS does not match, the cluster failed, or (without `check`, which knows
    better) a cluster that was up went away. NotServing after `timeout` says what was
    seen last.
    """
    deadline = time.monotonic() + timeout
    seen = "nothing answered"
    was_up = False
    with Client(address, token=token, tls_ca=tls_ca, options=PROMPT_RECONNECT) as client:
        while time.monotonic() < deadline:
            if check:
                check()
            ready = client.readiness()
            if ready.serving:
                return
            if was_up and not ready.answered and check is None:
                raise CommandFailed(
                    f"the cluster at {address} stopped before it served (its launcher says why)"
                )
            was_up = was_up or ready.answered
            seen = ready.seen
            time.sleep(0.2)
    raise NotServing(f"no cluster serving at {address} after {timeout:.0f} s: {seen}")


def chat_request(
    text: str, *, system: str = "", params: pb.SamplingParams | None = None, **kwargs: Any
) -> pb.GenerateRequest:
    messages = []
    if system:
        messages.append(pb.ChatMessage(role="system", content=system))
    messages.append(pb.ChatMessage(role="user", content=text))
    return pb.GenerateRequest(messages=messages, params=params or pb.SamplingParams(), **kwargs)


def response_json(response: pb.GenerateResponse) -> dict[str, Any]:
    """The CLI's --json shape: OpenAI-like field names, token ids and usage."""
    out: dict[str, Any] = {
        "text": response.text,
        "token_ids": list(response.token_ids),
        "finish_reason": response.finish_reason,
        "usage": {
            "prompt_tokens": response.usage.prompt_tokens,
            "completion_tokens": response.usage.completion_tokens,
            "total_tokens": response.usage.total_tokens,
            "reasoning_tokens": response.usage.reasoning_tokens,
            "cached_tokens": response.usage.cached_tokens,
        },
        "timings": json_format.MessageToDict(
            response.timings,
            preserving_proto_field_name=True,
            always_print_fields_with_no_presence=True,
        ),
        "request_id": response.request_id,
    }
    if response.reasoning:
        out["reasoning"] = response.reasoning
    if response.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": c.type or "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for c in response.tool_calls
        ]
    if response.unknown_tools:
        out["unknown_tools"] = list(response.unknown_tools)
    if response.malformed_tool_call:
        out["malformed_tool_call"] = True
    if response.logprobs:
        out["logprobs"] = [
            {
                "token": lp.token,
                "logprob": lp.logprob,
                "top_logprobs": [{"token": t.token, "logprob": t.logprob} for t in lp.top_logprobs],
            }
            for lp in response.logprobs
        ]
    return out


def status_json(status: pb.StatusResponse) -> str:
    return json.dumps(
        json_format.MessageToDict(
            status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        ),
        indent=2,
    )
