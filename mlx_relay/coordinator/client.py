"""A small Python client for a cluster's gRPC front door."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mlx_relay.coordinator.auth import auth_token, client_channel
from mlx_relay.protocol import relay_pb2 as pb
from mlx_relay.protocol import relay_pb2_grpc as pb_grpc


class Client:
    """`token` None reads MLX_RELAY_AUTH_TOKEN; `tls_ca` (PEM path or bytes) turns TLS on."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = None,
        token: str | None = None,
        tls_ca: str | bytes | None = None,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.channel = client_channel(address, token=auth_token(token), tls_ca=tls_ca)
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


def wait_serving(
    address: str,
    timeout: float,
    *,
    check: Callable[[], None] | None = None,
    token: str | None = None,
    tls_ca: str | bytes | None = None,
) -> None:
    """Block until the cluster at `address` reports SERVING; `check` may raise to give up."""
    deadline = time.monotonic() + timeout
    with Client(address, token=token, tls_ca=tls_ca) as client:
        while time.monotonic() < deadline:
            if check:
                check()
            if client.serving():
                return
            time.sleep(0.2)
    raise TimeoutError(f"no cluster serving at {address} after {timeout:.0f} s")


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
