"""The gRPC servicer: translate messages to engine calls and back, nothing more.

Generation logic lives in the engine; `Generate` is the aggregate of `GenerateStream`.
Requests are deserialized leniently so that malformed bytes get INVALID_ARGUMENT with
a reason instead of gRPC's generic INTERNAL.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from mlx_relay.coordinator import requests
from mlx_relay.coordinator.engine import Engine, EngineError, Request
from mlx_relay.coordinator.output import Chunk
from mlx_relay.coordinator.pipeline import ClusterFailure, RankFailure
from mlx_relay.coordinator.postprocess import DEFAULT_THINK_MARKERS, think_markers
from mlx_relay.model import memory
from mlx_relay.model.split import model_layers
from mlx_relay.protocol import relay_pb2 as pb
from mlx_relay.protocol.aggregate import aggregate

log = logging.getLogger("mlx_relay.service")

SERVICE_NAME = "mlx_relay.v1.Relay"

_STATUS = {
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
    except requests.InvalidRequest as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    except EngineError as e:
        context.abort(_STATUS[e.kind], str(e))
    except RankFailure as e:
        context.abort(grpc.StatusCode.UNAVAILABLE, str(e))


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
    """`model` and `layers`: what rank 0 was started with, what LoadModel loads again
    when it names no model (after a Free, say); a successful LoadModel replaces them."""

    def __init__(
        self, engine: Engine, *, backend: str = "", model: str = "", layers: str = ""
    ) -> None:
        self.engine = engine
        self.backend = backend
        self.last_model = model
        self.last_layers = layers

    def _tokenizer(self) -> Any:
        tokenizer = self.engine.tokenizer
        if tokenizer is None or self.engine.state != "serving":
            raise EngineError("unavailable", _not_serving(self.engine.state, self.engine.error))
        return tokenizer

    def _build(self, request: pb.GenerateRequest) -> Request:
        tokenizer = self._tokenizer()
        prompt = requests.render_prompt(
            tokenizer,
            prompt=request.prompt_bytes if request.prompt_bytes else request.prompt,
            messages=list(request.messages),
            tools_json=request.tools_json,
            chat_template_kwargs_json=request.chat_template_kwargs_json,
            tool_choice=request.tool_choice,
        )
        context = self.engine.context_length
        if context and len(prompt.token_ids) >= context:
            raise requests.InvalidRequest(
                f"the prompt is {len(prompt.token_ids)} tokens; the model's context is {context}"
            )
        params = requests.sampling_params(
            request.params,
            vocab_size=len(tokenizer),
            default_max_tokens=self.engine.default_max_tokens,
        )
        think_start, _ = think_markers(tokenizer) or DEFAULT_THINK_MARKERS
        return Request(
            prompt_tokens=prompt.token_ids,
            params=params,
            request_id=request.request_id or uuid.uuid4().hex[:12],
            tools=prompt.tools,
            parse_tools=prompt.tool_choice != "none",
            starts_in_reasoning=bool(request.messages)
            and requests.ends_in_reasoning(prompt.text, think_start),
            opens_tool_call=prompt.opens_tool_call,
        )

    def _stream(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateChunk]:
        req = self.engine.submit(self._build(request))
        context.add_callback(req.cancel)
        try:
            for chunk in req.chunks():
                yield chunk_to_proto(chunk, req.request_id)
        finally:
            req.cancel()  # a no-op once finished; frees the slot if the client went away

    @_stream_rpc
    def GenerateStream(self, request, context):  # noqa: N802 - gRPC method name
        yield from self._stream(request, context)

    @_rpc
    def Generate(self, request, context):  # noqa: N802
        return aggregate(self._stream(request, context))

    @_rpc
    def Tokenize(self, request, context):  # noqa: N802
        prompt = requests.render_prompt(
            self._tokenizer(),
            prompt=request.text,
            messages=list(request.messages),
            tools_json=request.tools_json,
            chat_template_kwargs_json=request.chat_template_kwargs_json,
            tool_choice=request.tool_choice,
        )
        return pb.TokenizeResponse(token_ids=prompt.token_ids, prompt=prompt.text)

    @_rpc
    def Status(self, request, context):  # noqa: N802
        return self.status()

    @_rpc
    def LoadModel(self, request, context):  # noqa: N802
        model = request.model or self.last_model
        layers_spec = request.layers if request.model or request.layers else self.last_layers
        if not model:
            raise requests.InvalidRequest("model is required ('default' or a path)")
        if self.engine.state in ("draining", "stopping", "failed"):
            raise EngineError("unavailable", f"the cluster is {self.engine.state}")
        layers = self._layers(layers_spec, model)
        try:
            self.engine.load(model, layers).result()
        except ClusterFailure:
            raise
        except RankFailure as e:  # a worker refused its shard; the cluster still serves
            raise EngineError("precondition", str(e)) from e
        except (EngineError, requests.InvalidRequest):
            raise
        except Exception as e:  # noqa: BLE001 - the load failed; say why, keep serving
            raise EngineError("invalid" if isinstance(e, ValueError) else "internal", str(e)) from e
        self.last_model, self.last_layers = model, layers_spec
        return pb.LoadModelResponse(status=self.status())

    def _layers(self, spec: str, model: str) -> list[int] | str | None:
        """LoadModel's `layers` for this model over this cluster's ranks."""
        try:
            return model_layers(spec, model, self._world())
        except ValueError as e:
            raise requests.InvalidRequest(f"layers: {e}") from e

    @_rpc
    def Free(self, request, context):  # noqa: N802
        message = self.engine.free(shutdown=request.shutdown).result()
        return pb.FreeResponse(message=message)

    def _world(self) -> int:
        return self.engine.pipeline.world_size

    def status(self) -> pb.StatusResponse:
        engine = self.engine
        pipeline = engine.pipeline
        loaded = pipeline.loaded
        active, queued = engine.counts()
        parked, parked_tokens = engine.cached_prompts()
        out = pb.StatusResponse(
            world_size=pipeline.world_size,
            state=engine.state,
            active_requests=active,
            queued_requests=queued,
            backend=self.backend,
            error=engine.error,
            cached_prompts=parked,
            cached_prompt_tokens=parked_tokens,
        )
        if loaded:
            out.model = loaded.spec
            out.model_path = loaded.path
            out.num_layers = loaded.num_layers
        out.ranks.append(_rank0_status(loaded))
        now = time.monotonic()
        for rank, info in sorted(pipeline.worker_stats().items()):
            start, end = loaded.ranges[rank] if loaded else (0, 0)
            out.ranks.append(
                pb.RankStatus(
                    rank=rank,
                    host=info.host,
                    pid=info.pid,
                    layer_start=start,
                    layer_end=end,
                    active_memory_bytes=info.stats.get("active_memory", 0),
                    peak_memory_bytes=info.stats.get("peak_memory", 0),
                    rss_bytes=info.stats.get("rss", 0),
                    free_memory_bytes=info.stats.get("free_memory", 0),
                    state=info.state,
                    last_seen_s=now - info.last_seen,
                )
            )
        return out


def _not_serving(state: str, error: str) -> str:
    """Why no request can run now, and what would change that."""
    if state == "unloaded":
        return (
            "no model is loaded (unloaded): `mlx-relay load` loads the last one again, "
            "`mlx-relay load --model PATH` another (the LoadModel RPC)"
        )
    if state in ("starting", "loading"):
        return f"no model is being served yet ({state}): `mlx-relay status --wait 60` waits"
    return f"no model is being served ({state}{': ' + error if error else ''})"


def _rank0_status(loaded: Any) -> pb.RankStatus:
    stats = memory.stats()
    start, end = loaded.ranges[0] if loaded else (0, 0)
    return pb.RankStatus(
        rank=0,
        host=socket.gethostname(),
        pid=os.getpid(),
        layer_start=start,
        layer_end=end,
        active_memory_bytes=stats["active_memory"],
        peak_memory_bytes=stats["peak_memory"],
        rss_bytes=stats["rss"],
        free_memory_bytes=stats["free_memory"],
        state="coordinator",
    )


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
