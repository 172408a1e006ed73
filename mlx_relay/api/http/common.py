"""What every HTTP door shares: one way to run a request, one error type, model names.

Each door's handler is its adapter: it turns the API's JSON into the typed
`generation.GenerationRequest` (with `sampling`, `tool_call` and `stop_list` here) and
nothing more; the checks are the coordinator's, for every door the same.
`generate` submits that request to the `Cluster` and returns an async stream
of the engine's chunks; a door streams them in its own format, or folds them with
`collect` for a non-streaming answer, so the two never diverge. The stream cancels
its request when the consumer goes away (a client that disconnects mid-stream).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HttpRequest
from starlette.responses import StreamingResponse

from mlx_relay.api.cluster import Cluster, error_kind
from mlx_relay.api.http.schemas import dumps, sse
from mlx_relay.api.metrics import Metrics, Observer
from mlx_relay.coordinator import generation, requests
from mlx_relay.coordinator.generation import GenerationRequest, ToolCall
from mlx_relay.coordinator.output import Chunk
from mlx_relay.coordinator.sampling import SamplingParams
from mlx_relay.coordinator.sequence import Request

# The HTTP status matching the gRPC status each error kind gets from the gRPC door
# (Google's mapping: INVALID_ARGUMENT and FAILED_PRECONDITION 400, UNAVAILABLE 503 ...).
STATUS = {
    "invalid": 400,
    "precondition": 400,
    "unauthenticated": 401,
    "not_found": 404,
    "no_route": 404,  # a path no door serves (a 405 too: answered as an unknown URL)
    "too_large": 413,
    "exhausted": 429,
    "cancelled": 499,
    "internal": 500,
    "unavailable": 503,
}


MAX_CHOICES = 16  # OpenAI's `n`: each choice is a request of its own


class HttpError(Exception):
    """A request refused, in words; each API's handler renders it in its own error shape."""

    def __init__(
        self, kind: str, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.param = param
        self.code = code  # the API's own code where the kind's default would mislead

    @property
    def status(self) -> int:
        return STATUS.get(self.kind, 500)


def tool_call(name: str, arguments: Any, id: str = "", type: str = "function") -> ToolCall:
    """An earlier assistant turn's call as the typed request holds it; the APIs send
    arguments as JSON text (OpenAI), an object (Ollama, Anthropic's input), or either."""
    text = arguments if isinstance(arguments, str) else dumps(arguments)
    return ToolCall(name=name, arguments=text, id=id, type=type)


def as_http_error(e: BaseException) -> HttpError:
    """The engine's and the request checks' errors as one HttpError."""
    if isinstance(e, HttpError):
        return e
    kind = error_kind(e)
    return HttpError(kind, str(e) if kind != "internal" else f"{type(e).__name__}: {e}")


@dataclass
class Door:
    """What a door's handlers need: the cluster (and the metrics its requests feed)."""

    cluster: Cluster

    @property
    def metrics(self) -> Metrics:
        return self.cluster.metrics

    def check_model(self, name: str | None) -> str:
        """The model a request names, if it is the one served; HttpError otherwise.

        A request may name it by its spec ('default' or the path it was loaded from) or
        the path's last part; leaving it out means the one served.
        """
        served = self.cluster.model_id()
        if not served:
            self.cluster.tokenizer()  # raises 'unavailable' saying why
        if not name or name in (served, served.rstrip("/").rsplit("/", 1)[-1]):
            return served
        raise HttpError(
            "not_found", f"model {name!r} is not served here; this cluster serves {served!r}"
        )

    async def render(self, request: GenerationRequest) -> requests.Prompt:
        try:
            return await run_in_threadpool(self.cluster.render, request)
        except Exception as e:  # noqa: BLE001 - mapped to the API's error
            raise as_http_error(e) from e

    async def generate(self, request: GenerationRequest, api: str) -> Output:
        """Submit now (errors come out here, before any response is sent); stream later."""
        try:
            req = await run_in_threadpool(self.cluster.submit, request, api)
        except Exception as e:  # noqa: BLE001 - mapped to the API's error (and counted)
            raise as_http_error(e) from e
        return Output(req, self.metrics.observe(req, api))

    async def generate_n(
        self, request: GenerationRequest | list[GenerationRequest], api: str, n: int
    ) -> Choices:
        """OpenAI's `n`: n requests, a seeded one seeded seed, seed+1, ... so they differ.
        Several requests (a list of prompts, /v1/completions): n choices each, in order,
        the choice of request i and copy j at index i * n + j, as OpenAI numbers them."""
        if not 1 <= n <= MAX_CHOICES:
            raise HttpError("invalid", f"n must be in [1, {MAX_CHOICES}], got {n}", "n")
        requests_ = request if isinstance(request, list) else [request]
        if not 1 <= len(requests_) * n <= MAX_CHOICES:
            raise HttpError(
                "invalid",
                f"{len(requests_)} prompts x n={n} choices is more than {MAX_CHOICES}",
                "prompt",
            )
        outputs: list[Output] = []
        try:
            for each in requests_:
                seed = each.sampling.seed
                for i in range(n):
                    one = each.with_seed(seed + i) if i and seed is not None else each
                    outputs.append(await self.generate(one, api))
        except BaseException:
            for output in outputs:
                output.request.cancel()
            raise
        return Choices(outputs, per_prompt=n)


class Output:
    """One request's chunks as an async iterator; closing it early cancels the request."""

    def __init__(self, request: Request, observer: Observer) -> None:
        self.request = request
        self.request_id = request.request_id
        self._observer = observer

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()

        def put(item: object) -> None:
            try:
                loop.call_soon_threadsafe(items.put_nowait, item)
            except RuntimeError:  # the loop is gone (server stopping): nobody listens
                self.request.cancel()

        def pump() -> None:
            try:
                for chunk in self.request.chunks():
                    put(chunk)
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                put(e)
            put(None)

        threading.Thread(target=pump, name="http-stream", daemon=True).start()
        try:
            while (item := await items.get()) is not None:
                if isinstance(item, Exception):
                    error = as_http_error(item)
                    self._observer.failed(error.kind)
                    raise error from item
                self._observer.chunk(item)
                yield item
        finally:
            self.request.cancel()  # a no-op once finished; frees the slot if the client went
            self._observer.close()

    def response(
        self, body: AsyncIterator[str], media_type: str = "text/event-stream"
    ) -> StreamingResponse:
        return streamed(body, [self.request], media_type)

    async def watched(self, http: HttpRequest) -> AsyncIterator[Chunk]:
        """The chunks, for a non-streaming answer: nothing is sent until the last one, so
        the client's disconnect is watched for here (a stream notices it when writing)."""
        async with cancelled_on_disconnect(http, [self.request]):
            async for chunk in self:
                yield chunk


@asynccontextmanager
async def cancelled_on_disconnect(
    http: HttpRequest, requests: list[Request]
) -> AsyncIterator[None]:
    """While inside, a client that leaves cancels `requests` (a non-streaming answer
    sends nothing until it is whole, so only its receive channel tells)."""

    async def watch() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass
        for request in requests:
            request.cancel()

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()


def streamed(
    body: AsyncIterator[str], requests: list[Request], media_type: str = "text/event-stream"
) -> StreamingResponse:
    """A streamed answer whose requests are cancelled however the response ends, even
    when the client leaves before the body is first iterated."""

    def cancel() -> None:
        for request in requests:
            request.cancel()

    return StreamingResponse(
        body,
        media_type=media_type,
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        background=BackgroundTask(cancel),
    )


class Choices:
    """Several outputs answering one call (OpenAI's `n`), as one stream or one answer."""

    def __init__(self, outputs: list[Output], per_prompt: int = 0) -> None:
        self.outputs = outputs
        self.request_id = outputs[0].request_id
        self.per_prompt = per_prompt or len(outputs)  # choices that share one prompt

    def usage(self, usages: list[dict[str, int]]) -> dict[str, int]:
        """The call's usage: each prompt counted once, every completion."""
        groups = [usages[i : i + self.per_prompt] for i in range(0, len(usages), self.per_prompt)]
        totals = [total_usage(g) for g in groups]
        return {k: sum(t.get(k, 0) for t in totals) for k in (totals[0] if totals else {})}

    def response(self, body: AsyncIterator[str]) -> StreamingResponse:
        return streamed(body, [o.request for o in self.outputs])

    async def merged(self) -> AsyncIterator[tuple[int, Chunk]]:
        """Every output's chunks as they come, each with its output's index."""
        queue: asyncio.Queue = asyncio.Queue()

        async def drain(index: int, output: Output) -> None:
            try:
                async for chunk in output:
                    queue.put_nowait((index, chunk))
            except HttpError as e:
                queue.put_nowait((index, e))
            finally:
                queue.put_nowait((index, None))

        tasks = [asyncio.create_task(drain(i, o)) for i, o in enumerate(self.outputs)]
        try:
            running = len(tasks)
            while running:
                index, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, HttpError):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            for output in self.outputs:
                output.request.cancel()

    async def collect(self, http: HttpRequest) -> list[Chunk]:
        """Every whole answer; all are cancelled if the client leaves before them."""
        wholes = [Chunk() for _ in self.outputs]
        async with cancelled_on_disconnect(http, [o.request for o in self.outputs]):
            async for index, chunk in self.merged():
                wholes[index].add(chunk)
        return wholes


def total_usage(usages: list[dict[str, int]]) -> dict[str, int]:
    """One call's usage over its choices: the prompt once, every completion."""
    first = usages[0] if usages else {}
    completion = sum(u.get("completion_tokens", 0) for u in usages)
    return {
        "prompt_tokens": first.get("prompt_tokens", 0),
        "cached_tokens": first.get("cached_tokens", 0),
        "completion_tokens": completion,
        "reasoning_tokens": sum(u.get("reasoning_tokens", 0) for u in usages),
        "total_tokens": first.get("prompt_tokens", 0) + completion,
        "draft_tokens": sum(u.get("draft_tokens", 0) for u in usages),
        "accepted_draft_tokens": sum(u.get("accepted_draft_tokens", 0) for u in usages),
    }


async def collect(output: Output, http: HttpRequest) -> Chunk:
    """The whole answer, the stream folded; the request is cancelled if the client
    leaves before it."""
    whole = Chunk()
    async for chunk in output.watched(http):
        whole.add(chunk)
    return whole


Events = list[tuple[str, dict[str, Any]]]  # (name, data) of server-sent events


class EventSource(Protocol):
    """An API's answer built from the engine's chunks, and the named events that build
    it as a stream (Anthropic's Messages, OpenAI's Responses)."""

    def start(self) -> Events: ...

    def feed(self, chunk: Chunk) -> Events: ...

    def failed(self, error: HttpError) -> Events: ...


async def sse_events(output: Output, source: EventSource) -> AsyncIterator[str]:
    """The streamed answer: `source`'s events as server-sent events, chunk by chunk; an
    error after the response began is the API's error event (its status is sent)."""
    for name, data in source.start():
        yield sse(data, name)
    try:
        async for chunk in output:
            for name, data in source.feed(chunk):
                yield sse(data, name)
    except HttpError as e:
        for name, data in source.failed(e):
            yield sse(data, name)


async def fold(output: Output, http: HttpRequest, source: EventSource) -> None:
    """The non-streaming answer: the same source fed the same chunks, its events dropped."""
    async for chunk in output.watched(http):
        source.feed(chunk)


def response_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's response_format as the typed request takes it (None for plain text)."""
    if not fmt or fmt.get("type") == "text":
        return None
    return fmt


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def sampling(**fields: Any) -> SamplingParams:
    """The engine's sampling options from the fields a request set (None: left to the
    server), by the engine's names; `stop` may be one string, `logit_bias` has OpenAI's
    string keys. Ranges are checked with every door's (generation.check_sampling)."""
    options: dict[str, Any] = {}
    for name, value in fields.items():
        if value is None:
            continue
        if name == "stop":
            value = stop_list(value)
        elif name == "logit_bias":
            try:
                value = requests.logit_bias(value)
            except requests.InvalidRequest as e:
                raise HttpError("invalid", str(e), name) from e
        options[name] = value
    return generation.sampling(**options)
