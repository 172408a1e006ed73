"""The gRPC servicer: translate messages to engine calls and back, nothing more.

A request becomes the typed request by this door's adapter (`grpc_adapter`); the
proto goes no further.

Generation logic lives in the engine; `Generate` is the aggregate of `GenerateStream`.
Requests are deserialized leniently so that malformed bytes get INVALID_ARGUMENT with
a reason instead of gRPC's generic INTERNAL.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from mlx_relay.api import grpc_adapter
from mlx_relay.api.cluster import REFUSALS, Cluster, error_kind
from mlx_relay.coordinator.output import Chunk
from mlx_relay.protocol import relay_pb2 as pb
from mlx_relay.protocol.aggregate import aggregate

log = logging.getLogger("mlx_relay.service")

SERVICE_NAME = "mlx_relay.v1.Relay"

_STATUS = {  # an EngineError's kind (api.cluster.error_kind) as a gRPC status
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "internal": grpc.StatusCode.INTERNAL,
    "cancelled": grpc.StatusCode.CANCELLED,
    "precondition": grpc.StatusCode.FAILED_PRECONDITION,
}


class _Undecodable:
    """Stands in for a request whose bytes did not parse."""

    def __init__(self, error: str) -> None:
        self.error = error


def _lenient(message_type: Any) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except (DecodeError, UnicodeDecodeError, ValueError) as e:
            return _Undecodable(f"the request is not a valid {message_type.DESCRIPTOR.name}: {e}")

    return deserialize


@contextmanager
def _statuses(request: Any, context: grpc.ServicerContext) -> Iterator[None]:
    """Map the engine's errors to gRPC statuses with the message a person can act on."""
    if isinstance(request, _Undecodable):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
    try:
        yield
    except REFUSALS as e:
        context.abort(grpc_status(e), str(e))


def grpc_status(e: Exception) -> grpc.StatusCode:
    """The gRPC status a gRPC door answers the engine's or the request checks' error with."""
    return _STATUS[error_kind(e)]


def _rpc(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(self: RelayServicer, request: Any, context: grpc.ServicerContext) -> Any:
        with _statuses(request, context):
            return fn(self, request, context)

    return wrapper


def _stream_rpc(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(self: RelayServicer, request: Any, context: grpc.ServicerContext) -> Iterator:
        with _statuses(request, context):
            yield from fn(self, request, context)

    return wrapper


def chunk_to_proto(chunk: Chunk, request_id: str) -> pb.GenerateChunk:
    out = pb.GenerateChunk(
        text=chunk.text,
        reasoning=chunk.reasoning,
        token_ids=chunk.token_ids,
        finish_reason=chunk.finish_reason or "",
        request_id=request_id,
        malformed_tool_call=chunk.malformed_tool_call,
        unknown_tools=chunk.unknown_tools,
        stop_sequence=chunk.stop_sequence,
        tool_calls=[
            pb.ToolCall(
                id=c.id,
                type="function",
                index=c.index,
                function=pb.ToolCallFunction(name=c.name, arguments=c.arguments),
            )
            for c in chunk.tool_calls
        ],
    )
    for lp in chunk.logprobs:
        out.logprobs.append(
            pb.TokenLogprob(
                token=lp.token,
                token_id=lp.token_id,
                logprob=lp.logprob,
                top_logprobs=[pb.TopLogprob(token_id=t, token=s, logprob=v) for t, s, v in lp.top],
            )
        )
    if chunk.usage:
        out.usage.CopyFrom(pb.Usage(**chunk.usage))
    if chunk.timings:
        out.timings.CopyFrom(pb.Timings(**chunk.timings))
    return out


class RelayServicer:
    """The project's own gRPC API over the shared `Cluster`."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def _stream(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateChunk]:
        req = self.cluster.submit(grpc_adapter.generate_request(request), "grpc")
        context.add_callback(req.cancel)
        for chunk in self.cluster.observed(req, "grpc"):
            yield chunk_to_proto(chunk, req.request_id)

    @_stream_rpc
    def GenerateStream(self, request, context):  # noqa: N802 - gRPC method name
        yield from self._stream(request, context)

    @_rpc
    def Generate(self, request, context):  # noqa: N802
        return aggregate(self._stream(request, context))

    @_rpc
    def Tokenize(self, request, context):  # noqa: N802
        prompt = self.cluster.render(grpc_adapter.tokenize_request(request))
        return pb.TokenizeResponse(token_ids=prompt.token_ids, prompt=prompt.text)

    @_rpc
    def Status(self, request, context):  # noqa: N802
        return self.cluster.status()

    @_rpc
    def LoadModel(self, request, context):  # noqa: N802
        self.cluster.load(request.model, request.layers)
        return pb.LoadModelResponse(status=self.cluster.status())

    @_rpc
    def Free(self, request, context):  # noqa: N802
        return pb.FreeResponse(message=self.cluster.free(shutdown=request.shutdown))


def add_to_server(servicer: RelayServicer, server: grpc.Server) -> None:
    unary = {
        "Generate": (pb.GenerateRequest, pb.GenerateResponse),
        "Tokenize": (pb.TokenizeRequest, pb.TokenizeResponse),
        "Status": (pb.StatusRequest, pb.StatusResponse),
        "LoadModel": (pb.LoadModelRequest, pb.LoadModelResponse),
        "Free": (pb.FreeRequest, pb.FreeResponse),
    }
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name),
            request_deserializer=_lenient(req),
            response_serializer=resp.SerializeToString,
        )
        for name, (req, resp) in unary.items()
    }
    handlers["GenerateStream"] = grpc.unary_stream_rpc_method_handler(
        servicer.GenerateStream,
        request_deserializer=_lenient(pb.GenerateRequest),
        response_serializer=pb.GenerateChunk.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
