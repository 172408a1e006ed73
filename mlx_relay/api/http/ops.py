"""Operations: `/health` (ready or not, and why), `/v1/status` (the cluster, as the
Status RPC shows it) and `/metrics` (Prometheus text).

Health is ready only when the engine serves a model, its loop thread is alive and no
worker is gone or silent: a live HTTP server over a dead generation thread is down.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from mlx_relay.api.http.common import Door
from mlx_relay.api.http.live import extend_status

_WIDE = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}


def _numbers(message: Message, out: dict[str, Any]) -> dict[str, Any]:
    """`out` (MessageToDict of `message`) with its 64-bit integers as JSON numbers:
    proto3's JSON mapping writes them as strings, which nobody reading byte counts
    expects (every value here is far below 2**53)."""
    for field in message.DESCRIPTOR.fields:
        value = out.get(field.name)
        if value is None:
            continue
        repeated = field.is_repeated
        if (
            field.type == FieldDescriptor.TYPE_MESSAGE
            and not field.message_type.GetOptions().map_entry
        ):
            items = getattr(message, field.name)
            if repeated:
                out[field.name] = [_numbers(m, o) for m, o in zip(items, value, strict=True)]
            else:
                out[field.name] = _numbers(items, value)
        elif field.type in _WIDE:
            out[field.name] = [int(v) for v in value] if repeated else int(value)
    return out


def router(door: Door) -> APIRouter:
    r = APIRouter()

    @r.get("/health")
    async def health() -> Any:
        cluster = door.cluster
        why = cluster.unhealthy()
        body = {
            "status": "unavailable" if why else "ok",
            "state": cluster.state,
            "model": cluster.model_id(),
            "ranks": cluster.world_size,
        }
        if why:
            body["reason"] = why
        return JSONResponse(body, status_code=503 if why else 200)

    @r.get("/v1/status")
    async def status() -> dict[str, Any]:
        """What `mlx-relay status` shows (the gRPC Status RPC), as JSON: every rank's layer
        range, host, pid and memory, running and queued requests, cached prompts."""
        reply = await run_in_threadpool(door.cluster.status)
        out = MessageToDict(
            reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        out = _numbers(reply, out)
        extend_status(out, door)  # (the live page's fields, JSON only)
        return out

    @r.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(door.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return r
