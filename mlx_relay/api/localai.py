"""LocalAI's `backend.Backend` gRPC service over the shared `Cluster`: a drop-in external
backend, so LocalAI's own API (chat, streaming, tools, reasoning) runs on the cluster.

A thin translation, like the native servicer: `PredictOptions` become the typed
`generation.GenerationRequest` (this module's adapter), the engine's chunks become `Reply` messages, and `Predict` is the
aggregate of `PredictStream`. What LocalAI expects of a backend is taken from its
repository: `Health` answers exactly "OK" while the backend can take `LoadModel` (the
loader polls for that), a model-identity mismatch is NOT_FOUND with the words "model
identity mismatch" (its router looks for both), bearer auth from
`LOCALAI_GRPC_AUTH_TOKEN`, and a `Reply` whose last message carries the token counts,
timings in milliseconds and the logprobs of the whole answer (LocalAI keeps the last).
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc

from mlx_relay.api.auth import TokenAuth
from mlx_relay.api.budget import Limit
from mlx_relay.api.cluster import REFUSALS, Cluster, not_serving
from mlx_relay.api.service import grpc_status
from mlx_relay.coordinator import generation, requests
from mlx_relay.coordinator.generation import GenerationRequest, Message, ToolCall
from mlx_relay.coordinator.output import Chunk, TokenLogprob
from mlx_relay.coordinator.sampling import SamplingParams
from mlx_relay.coordinator.sequence import EngineError
from mlx_relay.model import vision
from mlx_relay.protocol.localai import backend_pb2 as lpb
from mlx_relay.protocol.localai import backend_pb2_grpc as lpb_grpc

log = logging.getLogger("mlx_relay.localai")

TOKEN_ENV = "LOCALAI_GRPC_AUTH_TOKEN"  # what LocalAI gives the backends it starts
MISMATCH = "model identity mismatch"  # LocalAI's router matches this text with NOT_FOUND
LOAD_WAIT_S = 600.0  # LoadModel waits this long at most for a cluster still loading


class NotFound(Exception):
    """A request for another model than the one LoadModel loaded."""


def _map_errors(fn: Callable) -> Callable:
    """The engine's errors as gRPC statuses, for unary and streaming methods alike."""

    def abort(context: grpc.ServicerContext, e: Exception) -> None:
        if isinstance(e, NotFound):
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        context.abort(grpc_status(e), str(e))

    errors = (*REFUSALS, NotFound)

    @functools.wraps(fn)
    def unary(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(self, request, context)
        except errors as e:
            abort(context, e)

    @functools.wraps(fn)
    def stream(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator:
        try:
            yield from fn(self, request, context)
        except errors as e:
            abort(context, e)

    return stream if inspect.isgeneratorfunction(fn) else unary


# --- PredictOptions -> GenerationRequest ----------------------------------------------


def _messages(options: lpb.PredictOptions) -> list[Message]:
    out = []
    for i, m in enumerate(options.Messages):
        calls = []
        for call in requests.json_field(m.tool_calls, f"Messages[{i}].tool_calls", list) or []:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                raise requests.InvalidRequest(
                    f"Messages[{i}].tool_calls must be a list of "
                    '{"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}'
                )
            arguments = function.get("arguments", "")
            calls.append(
                ToolCall(
                    name=str(function.get("name", "")),
                    arguments=arguments if isinstance(arguments, str) else json.dumps(arguments),
                    id=str(call.get("id", "")),
                    type=str(call.get("type") or "function"),
                )
            )
        out.append(
            Message(
                role=m.role,
                content=m.content,
                name=m.name,
                tool_call_id=m.tool_call_id,
                reasoning=m.reasoning_content,
                tool_calls=tuple(calls),
            )
        )
    return out


def _tool_choice(raw: str) -> str:
    """LocalAI sends tool_choice as JSON: a string ("auto") or an object naming a function."""
    raw = raw.strip()
    if raw.startswith('"'):
        return requests.json_field(raw, "ToolChoice", str)
    return raw  # 'auto' unquoted, or an object (JSON text) the engine's parser reads


def _template_kwargs(metadata: dict[str, str]) -> dict[str, Any]:
    """Metadata's reasoning levers as chat-template kwargs (its JSON blob wins, as in LocalAI)."""
    kwargs: dict[str, Any] = {}
    thinking = metadata.get("enable_thinking", "").strip().lower()
    if thinking in ("true", "false"):
        kwargs["enable_thinking"] = thinking == "true"
    elif thinking:
        raise requests.InvalidRequest(
            f"Metadata enable_thinking must be 'true' or 'false', got {thinking!r}"
        )
    if metadata.get("reasoning_effort"):
        kwargs["reasoning_effort"] = metadata["reasoning_effort"]
    blob = metadata.get("chat_template_kwargs", "")
    kwargs.update(requests.json_field(blob, "Metadata chat_template_kwargs", dict) or {})
    return kwargs


def _params(options: lpb.PredictOptions, vocab_size: int) -> SamplingParams:
    """LocalAI's sampling fields as the engine's; proto3 zero means "not set" except for
    Temperature, where 0 means greedy (never rewritten)."""
    bias = requests.json_field(options.LogitBias, "LogitBias", dict)
    return generation.sampling(
        temperature=options.Temperature,
        top_p=options.TopP,
        # top_k as large as the vocabulary keeps every token: the same as no top_k.
        top_k=options.TopK if 0 < options.TopK < vocab_size else 0,
        min_p=options.MinP,
        ignore_eos=options.IgnoreEOS,
        stop=[s for s in options.StopPrompts if s],
        logprobs=options.Logprobs > 0 or options.TopLogprobs > 0,
        top_logprobs=max(options.TopLogprobs, 0),
        repetition_context_size=max(options.Repeat, 0) or None,
        seed=options.Seed if options.Seed > 0 else None,  # LocalAI sends a random one unasked
        repetition_penalty=options.Penalty or None,
        frequency_penalty=options.FrequencyPenalty or None,
        presence_penalty=options.PresencePenalty or None,
        logit_bias=requests.logit_bias(bias or {}, "LogitBias"),
    )


def generate_request(options: lpb.PredictOptions, vocab_size: int) -> GenerationRequest:
    """The typed request for LocalAI's PredictOptions (the checks are the coordinator's)."""
    for field in ("Videos", "Audios"):
        if getattr(options, field):
            raise requests.InvalidRequest(
                f"{field}: mlx-relay serves language and vision-language models; use an "
                "audio or video backend for these"
            )
    prompt, messages = "", []
    if options.Messages and (options.UseTokenizerTemplate or not options.Prompt):
        messages = _messages(options)
    elif options.Images:  # as LocalAI's mlx-vlm backend does: the prompt as a user message
        messages = [Message(role="user", content=options.Prompt)]
    else:
        prompt = options.Prompt
    if options.Images:
        messages = _with_images(messages, options.Images)
    return GenerationRequest(
        prompt=prompt,
        messages=tuple(messages),
        max_tokens=options.Tokens if options.Tokens > 0 else None,
        sampling=_params(options, vocab_size),
        tools=generation.tools(requests.json_field(options.Tools, "tools", list)),
        tool_choice=_tool_choice(options.ToolChoice),
        chat_template_kwargs=_template_kwargs(dict(options.Metadata)),
        request_id=options.CorrelationId[:64],
        grammar=options.Grammar,
    )


def _with_images(messages: list[Message], images: Iterable[str]) -> list[Message]:
    """LocalAI sends a request's images (base64) apart from its messages; like its mlx-vlm
    backend, show them with the last user message, before its text."""
    users = [i for i, m in enumerate(messages) if m.role == "user"]
    if not users:
        raise requests.InvalidRequest("Images: the request has no user message to show them in")
    files = []
    for i, data in enumerate(images):
        try:
            files.append(vision.b64decode_image(data, f"Images[{i}]"))
        except vision.VisionError as e:
            raise requests.InvalidRequest(str(e)) from None
    last = messages[users[-1]]
    out = list(messages)
    out[users[-1]] = replace(last, images=(*last.images, *files))
    return out


# --- chunks -> Reply ---------------------------------------------------------------------


def _logprob_json(entries: Iterable[TokenLogprob]) -> bytes:
    """OpenAI's logprobs shape, as LocalAI's schema.Logprobs reads it."""

    def one(token_id: int, token: str, logprob: float) -> dict[str, Any]:
        return {
            "id": token_id,
            "token": token,
            "bytes": list(token.encode()),
            "logprob": logprob,
        }

    content = [
        {**one(e.token_id, e.token, e.logprob), "top_logprobs": [one(*t) for t in e.top]}
        for e in entries
    ]
    return json.dumps({"content": content}).encode() if content else b""


def _delta(chunk: Chunk) -> lpb.ChatDelta:
    return lpb.ChatDelta(
        content=chunk.text,
        reasoning_content=chunk.reasoning,
        tool_calls=[
            lpb.ToolCallDelta(index=c.index, id=c.id, name=c.name, arguments=c.arguments)
            for c in chunk.tool_calls
        ],
    )


def aggregate(replies: Iterable[lpb.Reply]) -> lpb.Reply:
    """Predict's answer: the stream's replies in one (text, deltas merged, last counts)."""
    out = lpb.Reply()
    delta = lpb.ChatDelta()
    for reply in replies:
        out.message += reply.message
        for d in reply.chat_deltas:
            delta.content += d.content
            delta.reasoning_content += d.reasoning_content
            delta.tool_calls.extend(d.tool_calls)
        out.tokens, out.prompt_tokens = reply.tokens, reply.prompt_tokens
        out.timing_prompt_processing = reply.timing_prompt_processing
        out.timing_token_generation = reply.timing_token_generation
        out.logprobs = reply.logprobs or out.logprobs
    out.chat_deltas.append(delta)
    return out


# --- the service ---------------------------------------------------------------------------


class Metrics:
    """What GetMetrics reports: totals since start and the last answer's decode speed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.tokens_generated = 0
        self.prompt_tokens = 0
        self.tokens_per_second = 0.0

    def add(self, chunk: Chunk) -> None:
        with self._lock:
            usage = chunk.usage or {}
            self.tokens_generated += usage.get("completion_tokens", 0)
            self.prompt_tokens += usage.get("prompt_tokens", 0)
            self.tokens_per_second = (chunk.timings or {}).get("decode_tokens_per_s", 0.0)


class LocalAIServicer(lpb_grpc.BackendServicer):
    """LocalAI's backend service over the shared `Cluster`.

    `identity`: the `Model` LocalAI's last LoadModel named, which later requests'
    `ModelIdentity` must match. `context_size`: LoadModel's ContextSize, a cap on prompt
    plus answer below the model's own context (0: the model's).
    """

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.identity = ""
        self.context_size = 0
        self.metrics = Metrics()
        self._load_lock = threading.Lock()

    # health and lifecycle

    def Health(self, request, context):  # noqa: N802 - gRPC method name
        """Exactly "OK" while LoadModel can be served (LocalAI polls for those bytes)."""
        state = self.cluster.state
        if state in ("failed", "stopping", "draining"):
            return lpb.Reply(message=not_serving(state, self.cluster.error).encode())
        return lpb.Reply(message=b"OK")

    @_map_errors
    def LoadModel(self, request, context):  # noqa: N802
        for field in ("LoraAdapter", "LoraAdapters", "DraftModel", "MMProj"):
            if getattr(request, field):
                raise requests.InvalidRequest(f"{field} is not supported by mlx-relay")
        with self._load_lock:  # LocalAI may retry; one reload after a Free is enough
            self._wait_loaded(context)
            loaded = self.cluster.loaded
            spec, path = (loaded.spec, loaded.path) if loaded else (self.cluster.last_model,) * 2
            if not _same_model(request, spec, path):
                raise requests.InvalidRequest(
                    f"this cluster serves {spec!r} ({path}), not {request.Model!r}: mlx-relay "
                    "holds one model across all its ranks; start it with "
                    f"--model {request.Model or 'PATH'} to serve that one"
                )
            if self.cluster.state == "unloaded":  # after a Free: load it again
                self.cluster.load()
            loaded = self.cluster.loaded
            if loaded is None:
                raise EngineError("unavailable", not_serving(self.cluster.state, ""))
            limit = self.cluster.context_length
            if limit and request.ContextSize > limit:
                raise requests.InvalidRequest(
                    f"ContextSize {request.ContextSize} is beyond the model's context of "
                    f"{limit} tokens: set context_size to {limit} or less in the LocalAI "
                    "model config"
                )
            self.context_size = max(request.ContextSize, 0)  # 0 or less: the model's own
            self.identity = request.Model
        return lpb.Result(success=True, message=f"serving {loaded.spec} ({loaded.path})")

    def _wait_loaded(self, context: grpc.ServicerContext) -> None:
        """A cluster still starting or loading its model answers once it is done."""
        remaining = context.time_remaining()
        deadline = time.monotonic() + min(LOAD_WAIT_S, remaining or LOAD_WAIT_S)
        while self.cluster.state in ("starting", "loading"):
            if time.monotonic() > deadline or not context.is_active():
                raise EngineError("unavailable", not_serving(self.cluster.state, ""))
            time.sleep(0.1)

    @_map_errors
    def Free(self, request, context):  # noqa: N802
        return lpb.Result(success=True, message=self.cluster.free())

    @_map_errors
    def Status(self, request, context):  # noqa: N802
        status = self.cluster.status()
        states = lpb.StatusResponse
        if status.state == "serving":
            busy = status.active_requests or status.queued_requests
            state = states.BUSY if busy else states.READY
        elif status.state == "failed":
            state = states.ERROR
        else:
            state = states.UNINITIALIZED
        memory = lpb.MemoryUsageData()
        for rank in status.ranks:
            used = rank.active_memory_bytes or rank.rss_bytes
            memory.breakdown[f"rank{rank.rank}"] = used
            memory.total += used
        return lpb.StatusResponse(state=state, memory=memory)

    # generation

    def _check_identity(self, options: lpb.PredictOptions) -> None:
        wanted = options.ModelIdentity
        if wanted and self.identity and wanted != self.identity:
            raise NotFound(f"{MISMATCH}: loaded {self.identity!r}, requested {wanted!r}")

    def _request(self, options: lpb.PredictOptions) -> GenerationRequest:
        self._check_identity(options)
        return generate_request(options, len(self.cluster.tokenizer()))

    def _replies(self, options: lpb.PredictOptions, context) -> Iterator[lpb.Reply]:
        # LoadModel's ContextSize caps prompt + answer as the cluster's own limits do
        # (api/budget.py: Tokens is a ceiling, cut to the room left).
        limit = Limit(self.context_size, "LoadModel's ContextSize")
        req = self.cluster.submit(self._request(options), "localai", limit)
        context.add_callback(req.cancel)
        prompt_tokens = len(req.prompt_tokens)
        generated = 0
        logprobs: list[TokenLogprob] = []
        for chunk in self.cluster.observed(req, "localai"):
            generated += len(chunk.token_ids)
            logprobs += chunk.logprobs
            delta = _delta(chunk)
            reply = lpb.Reply(
                message=chunk.text.encode(),
                tokens=generated,
                prompt_tokens=prompt_tokens,
                chat_deltas=[delta] if delta.ByteSize() else [],
                logprobs=_logprob_json(chunk.logprobs),
            )
            if chunk.finish_reason is not None:
                self._finish(reply, chunk, logprobs)
            yield reply

    def _finish(self, reply: lpb.Reply, chunk: Chunk, logprobs: list[TokenLogprob]) -> None:
        """The last reply: the engine's counts, both timings in ms, every logprob."""
        self.metrics.add(chunk)
        usage, timings = chunk.usage or {}, chunk.timings or {}
        reply.tokens = usage.get("completion_tokens", reply.tokens)
        reply.prompt_tokens = usage.get("prompt_tokens", reply.prompt_tokens)
        first = timings.get("time_to_first_token_s", 0.0)
        reply.timing_prompt_processing = first * 1000
        reply.timing_token_generation = max(timings.get("total_s", 0.0) - first, 0.0) * 1000
        reply.logprobs = _logprob_json(logprobs)

    @_map_errors
    def PredictStream(self, request, context):  # noqa: N802
        yield from self._replies(request, context)

    @_map_errors
    def Predict(self, request, context):  # noqa: N802
        return aggregate(self._replies(request, context))

    # the model's facts

    @_map_errors
    def TokenizeString(self, request, context):  # noqa: N802
        self._check_identity(request)
        tokenizer = self.cluster.tokenizer()
        if request.Messages and (request.UseTokenizerTemplate or not request.Prompt):
            tokens = self.cluster.render(generate_request(request, len(tokenizer))).token_ids
        else:
            tokens = requests.encode_text(tokenizer, request.Prompt)
        return lpb.TokenizationResponse(length=len(tokens), tokens=tokens)

    @_map_errors
    def Detokenize(self, request, context):  # noqa: N802
        tokenizer = self.cluster.tokenizer()
        bad = [t for t in request.tokens if not 0 <= t < len(tokenizer)]
        if bad:
            raise requests.InvalidRequest(
                f"token ids {bad[:5]} are outside the vocabulary (0..{len(tokenizer) - 1})"
            )
        return lpb.DetokenizeResponse(content=tokenizer.decode(list(request.tokens)))

    @_map_errors
    def ModelMetadata(self, request, context):  # noqa: N802
        tokenizer = self.cluster.tokenizer()
        markup = self.cluster.markup()
        out = lpb.ModelMetadataResponse(supports_thinking=markup.thinks)
        if markup.thinks:
            out.tool_format.reasoning_start = markup.think_start
            out.tool_format.reasoning_end = markup.think_end
        if getattr(tokenizer, "has_tool_calling", False):
            out.tool_format.section_start = tokenizer.tool_call_start or ""
            out.tool_format.section_end = tokenizer.tool_call_end or ""
        if getattr(tokenizer, "chat_template", None):
            sample = GenerationRequest(
                messages=(Message(role="user", content="Hello"),),
                chat_template_kwargs={"enable_thinking": True},
            )
            out.rendered_template = self.cluster.render(sample).text
        return out

    def GetMetrics(self, request, context):  # noqa: N802
        m = self.metrics
        return lpb.MetricsResponse(
            tokens_per_second=m.tokens_per_second,
            tokens_generated=m.tokens_generated,
            prompt_tokens_processed=m.prompt_tokens,
        )


def _same_model(request: lpb.ModelOptions, spec: str, path: str) -> bool:
    """LoadModel names the served model: by its spec ('default', a path) or a path to it."""
    if request.Model in ("", spec, path):
        return True
    here = _resolved(path)
    return any(_resolved(p) == here for p in (request.Model, request.ModelFile) if p)


def _resolved(path: str) -> Path | None:
    try:
        return Path(path).expanduser().resolve()
    except (OSError, RuntimeError):
        return None


class _Unimplemented(grpc.GenericRpcHandler):
    """Every other method of LocalAI's service (images, audio, embeddings ...)."""

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        prefix = f"/{lpb.DESCRIPTOR.services_by_name['Backend'].full_name}/"
        if not details.method.startswith(prefix):
            return None
        name = details.method[len(prefix) :]

        def refuse(requests_: Any, context: grpc.ServicerContext) -> Iterator[bytes]:
            context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                f"{name} is not implemented: mlx-relay serves a language model (Predict, "
                "PredictStream, TokenizeString, ...)",
            )
            yield b""  # pragma: no cover - abort raises

        return grpc.stream_stream_rpc_method_handler(refuse)


def serve(
    cluster: Cluster, address: str, *, token: str, threads: int, max_request_bytes: int
) -> grpc.Server:
    """Start LocalAI's service on `address` (its own server: its own port and token).

    The token is LocalAI's (`LOCALAI_GRPC_AUTH_TOKEN`, which LocalAI hands the backends
    it starts) else the cluster's own; without either, no auth. Raises OSError when the
    address cannot be listened on.
    """
    token = os.environ.get(TOKEN_ENV) or token
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="localai"),
        interceptors=[TokenAuth(token)] if token else [],
        options=[
            ("grpc.max_receive_message_length", max_request_bytes),
            ("grpc.so_reuseport", 0),
        ],
        maximum_concurrent_rpcs=threads,
    )
    lpb_grpc.add_BackendServicer_to_server(LocalAIServicer(cluster), server)
    server.add_generic_rpc_handlers((_Unimplemented(),))
    try:
        port = server.add_insecure_port(address)
    except (RuntimeError, OSError):
        port = 0
    if port == 0:
        raise OSError(f"cannot listen on {address} for LocalAI: in use or not this machine's")
    server.start()
    log.info("LocalAI backend service on %s%s", address, ", bearer token required" if token else "")
    if not token and not address.startswith(("127.0.0.1", "localhost", "[::1]", "unix:")):
        log.warning(
            "LocalAI's service on %s is reachable from other machines and needs no token: "
            "set %s (LocalAI sends it) or MLX_RELAY_AUTH_TOKEN",
            address,
            TOKEN_ENV,
        )
    return server
