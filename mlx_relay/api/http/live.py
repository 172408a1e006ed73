"""The live page: `GET /` serves one self-contained HTML page (`static/live.html`: plain
HTML, CSS, JavaScript and inline SVG, nothing fetched from elsewhere) that shows the
cluster as it runs, and `GET /v1/status/stream` feeds it.

The stream is server-sent events, one `status` event a second and one at once whenever
the cluster's state or the reason it cannot serve changes: `/v1/status`'s JSON (with the
fields `extend_status` adds) plus the request counters of `/metrics`. A cluster that
fails exits soon after (rank 0 exits 3): the event that says why goes out before the
stream ends, so the page shows the reason and then, with its last known state, that rank 0
no longer answers.

The page itself is served without a token, so that it can ask for one; everything it
reads goes through the same bearer token as every other route (`app.Guard`). It answers
`GET /` from a browser (Accept: text/html); anything else at `/` gets the one line it got
before (Ollama's clients probe it), so this router comes before Ollama's.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from functools import cache
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse, PlainTextResponse, StreamingResponse
from google.protobuf.json_format import MessageToDict
from starlette.concurrency import run_in_threadpool

from mlx_relay.api.http.common import Door
from mlx_relay.model import memory

PAGE_PATH = "/"
RUNNING = "mlx-relay is running (Ollama's API under /api, OpenAI's under /v1)"
EVENT_INTERVAL_S = 1.0  # a status event this often
WATCH_INTERVAL_S = 0.1  # and one at once when the state changes (looked at this often)
ENDED = ("failed", "stopping")  # rank 0 is about to exit: the stream ends after saying so


def wants_page(accept: str) -> bool:
    """A browser asks for HTML first; Ollama's clients and curl do not."""
    return "text/html" in accept.lower()


@cache
def page() -> str:
    return resources.files("mlx_relay.api.http").joinpath("static/live.html").read_text("utf-8")


def status_body(door: Door) -> dict[str, Any]:
    """`/v1/status`'s JSON: the Status RPC's reply, with `extend_status`'s fields."""
    reply = door.cluster.status()
    body = MessageToDict(
        reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    extend_status(body, door)
    return body


def extend_status(body: dict[str, Any], door: Door) -> None:
    """Add what the live page needs beyond the Status RPC (JSON only, the RPC unchanged):

    - `hop_mode`, `heartbeat_timeout_s`, `max_active`, `max_queue`;
    - `failure`: why the cluster cannot serve now ('' if it can), named before the
      watchdog has failed the cluster (a rank gone, or silent);
    - `tokens`: prompt tokens prefilled and tokens decoded round the ring so far, and
      `ring_steps`: forward steps and their seconds by kind (rates come from deltas);
    - per rank: `memory_limit_bytes` (MLX_RELAY_MEMORY_LIMIT, 0: none), `cache_memory_bytes`,
      `steps` and `step_seconds` (a worker's own, as its heartbeats say; rank 0's are the
      ring's round trips), `gone`, `ring_broken` and `alert`: why the rank stands out
      ('gone: ...', 'silent: ...', 'slow: ...' for a late heartbeat or a step it holds
      for 4 times what it should take, or the failure that names it).
    """
    cluster = door.cluster
    ring = cluster.ring()
    body["hop_mode"] = ring.hop_mode
    body["heartbeat_timeout_s"] = ring.heartbeat_timeout
    body["max_active"] = ring.max_active
    body["max_queue"] = ring.max_queue
    body["failure"] = cluster.unhealthy() if cluster.state in ("serving", "failed") else ""
    steps = cluster.steps()
    body["tokens"] = {
        kind: steps[kind].tokens if kind in steps else 0 for kind in ("prefill", "decode")
    }
    body["ring_steps"] = {k: {"steps": s.steps, "seconds": s.seconds} for k, s in steps.items()}
    workers = cluster.workers()
    lagging = cluster.lagging()
    for row in body.get("ranks", []):
        rank = int(row.get("rank", 0))
        if rank == 0:
            stats = memory.stats()
            row["memory_limit_bytes"] = stats.get("memory_limit", 0)
            row["cache_memory_bytes"] = stats.get("cache_memory", 0)
            row["steps"] = sum(s.steps for s in steps.values())
            row["step_seconds"] = sum(s.seconds for s in steps.values())
            row["gone"] = row["ring_broken"] = ""
            row["alert"] = ""
            continue
        info = workers.get(rank)
        stats = info.stats if info is not None else {}
        row["memory_limit_bytes"] = int(stats.get("memory_limit", 0))
        row["cache_memory_bytes"] = int(stats.get("cache_memory", 0))
        row["steps"] = int(stats.get("steps", 0))
        row["step_seconds"] = float(stats.get("step_seconds", 0.0))
        row["gone"] = info.gone if info is not None else ""
        row["ring_broken"] = info.ring_broken if info is not None else ""
        slow = lagging.reason if lagging is not None and lagging.rank == rank else ""
        row["alert"] = _alert(row, ring.heartbeat_timeout, ring.heartbeat_interval, slow)
    _blame(body)


def _alert(row: dict[str, Any], heartbeat_timeout: float, interval: float, slow: str) -> str:
    """Why a worker stands out, in the cluster's words ('' when it does not); `slow`: the
    step it holds for too long (`Pipeline.lagging`), if it does."""
    if row["gone"]:
        return f"gone: {row['gone']}"
    silent = float(row.get("last_seen_s", 0.0))
    if silent > heartbeat_timeout:
        return f"silent: no heartbeat for {silent:.1f} s (stopped, hung or cut off)"
    if row["ring_broken"]:
        return f"its ring connection broke: {row['ring_broken']}"
    if slow:
        return f"slow: {slow}"
    if silent > 3 * interval:
        return f"slow: last heartbeat {silent:.1f} s ago"
    return ""


def _blame(body: dict[str, Any]) -> None:
    """The rank a failure names (`rank N (host): ...`) gets it as its alert."""
    why = body.get("error") or body.get("failure") or ""
    if not why:
        return
    for row in body.get("ranks", []):
        rank = int(row.get("rank", 0))
        if rank and f"rank {rank} " in why + " " and not row.get("alert"):
            row["alert"] = why


def metric_values(door: Door) -> dict[str, float]:
    """The request counters of `/metrics` the page draws (totals; it takes the rates)."""
    wanted = {
        "mlx_relay:time_to_first_token_seconds_sum": "ttft_sum",
        "mlx_relay:time_to_first_token_seconds_count": "ttft_count",
        "mlx_relay:prompt_tokens_total": "prompt_tokens",
        "mlx_relay:generation_tokens_total": "generation_tokens",
        "mlx_relay:prefix_cache_queries_total": "cache_queries",
        "mlx_relay:prefix_cache_hits_total": "cache_hits",
        "mlx_relay:prompt_cache_hit_requests_total": "cache_hit_requests",
        "mlx_relay:requests_total": "requests",
    }
    out = dict.fromkeys(wanted.values(), 0.0)
    registry = door.metrics.registry
    for family in registry.collect():
        for sample in family.samples:
            key = wanted.get(sample.name)
            if key is not None:
                out[key] += sample.value
    return out


def event(door: Door) -> dict[str, Any]:
    return {"time": time.time(), "status": status_body(door), "metrics": metric_values(door)}


def router(door: Door) -> APIRouter:
    r = APIRouter()

    @r.get(PAGE_PATH, include_in_schema=False)
    async def live_page(request: Request) -> Response:
        """The page for a browser; for anything else (Ollama's clients probe `/`), the
        one line `ollama.py`'s route of this path gives."""
        if wants_page(request.headers.get("accept", "")):
            return HTMLResponse(page(), headers={"Cache-Control": "no-store"})
        return PlainTextResponse(RUNNING)

    @r.get("/v1/status/stream")
    async def status_stream() -> StreamingResponse:
        """Server-sent `status` events (see the module's docstring)."""
        return StreamingResponse(
            _events(door),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    return r


async def _events(door: Door) -> AsyncIterator[str]:
    cluster = door.cluster
    last_sent = 0.0
    last_key: tuple[str, str, str, int] | None = None
    while True:
        ended = cluster.state in ENDED or not cluster.running
        lagging = cluster.lagging()
        key = (cluster.state, cluster.error, cluster.unhealthy(), lagging.rank if lagging else 0)
        now = time.monotonic()
        if ended or key != last_key or now - last_sent >= EVENT_INTERVAL_S:
            body = await run_in_threadpool(event, door)
            yield f"event: status\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"
            last_sent, last_key = now, key
            if ended:
                return
        await asyncio.sleep(WATCH_INTERVAL_S)
