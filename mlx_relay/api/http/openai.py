"""OpenAI's API: chat completions, completions, models, tokenize/detokenize.

Fields map one to one onto the typed `GenerationRequest` (sampling onto the engine's
`SamplingParams` by name, so the coordinator does every check); a non-streaming answer
is the stream folded
by `common.collect`. The Responses API is in `responses.py`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request

from mlx_relay.api.http.common import (
    Choices,
    Door,
    HttpError,
    response_format,
    sampling,
    tool_call,
)
from mlx_relay.api.http.schemas import Lenient, sse
from mlx_relay.coordinator import generation
from mlx_relay.coordinator.generation import GenerationRequest, Message
from mlx_relay.coordinator.output import Chunk, TokenLogprob
from mlx_relay.coordinator.sampling import SamplingParams
from mlx_relay.model import vision

API = "openai"
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    499: "invalid_request_error",
}
ERROR_CODES = {401: "invalid_api_key", 404: "model_not_found", 413: "request_too_large"}


def error_body(e: HttpError) -> dict[str, Any]:
    """OpenAI's error object."""
    return {
        "error": {
            "message": str(e),
            "type": ERROR_TYPES.get(e.status, "server_error"),
            "param": e.param,
            "code": e.code or (None if e.kind == "no_route" else ERROR_CODES.get(e.status, e.kind)),
        }
    }


# --- request schemas ------------------------------------------------------------------
class ImageUrl(Lenient):
    url: str


class ContentPart(Lenient):
    type: str
    text: str | None = None
    image_url: ImageUrl | str | None = None


class FunctionIn(Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(Lenient):
    id: str = ""
    type: str = "function"
    function: FunctionIn


class MessageIn(Lenient):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class StreamOptions(Lenient):
    include_usage: bool = False


class SamplingFields(Lenient):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    ignore_eos: bool | None = None  # vLLM's extension
    num_draft_tokens: int | None = None  # mlx_lm.server's: speculative proposals (0: none)

    def params(self, logprobs: bool, top_logprobs: int | None) -> SamplingParams:
        return sampling(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias,
            ignore_eos=self.ignore_eos,
            num_draft_tokens=self.num_draft_tokens,
            logprobs=logprobs or None,
            top_logprobs=top_logprobs,
        )

    def format(self) -> dict[str, Any] | None:
        return response_format(self.response_format)


class ChatRequest(SamplingFields):
    messages: list[MessageIn]
    cache_salt: str | None = None  # vLLM's: no cached prefix shared across salts
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str]
    cache_salt: str | None = None
    logprobs: int | None = None
    echo: bool = False


class TokenizeRequest(Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[MessageIn] | None = None
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(Lenient):
    model: str | None = None
    tokens: list[int]


# --- translation ----------------------------------------------------------------------
def message_content(content: str | list[ContentPart] | None, where: str) -> dict[str, Any]:
    """A message's text and its images where they are among the text (`image_url` parts
    with base64 data: URLs; the server fetches nothing), as `Message` fields. A
    text-only model refuses the images (Cluster.build)."""
    parts = vision.MessageParts()
    if content is None or isinstance(content, str):
        parts.text(content or "")
        return parts.fields()
    for i, part in enumerate(content):
        if part.type in ("text", "input_text", "output_text") and part.text is not None:
            parts.text(part.text)
        elif part.type == "image_url" and part.image_url is not None:
            parts.image(image_bytes(part.image_url, f"{where}.content[{i}].image_url"))
        else:
            raise HttpError(
                "invalid",
                f"{where}.content[{i}] is a {part.type!r} part: this server reads text and "
                "image_url parts only (audio and files are not supported)",
                f"{where}.content",
            )
    return parts.fields()


def image_bytes(image: ImageUrl | str, where: str) -> bytes:
    """The file bytes of a `data:image/...;base64,...` URL; other URLs are refused."""
    url = image if isinstance(image, str) else image.url
    if not url.startswith("data:"):
        raise HttpError(
            "invalid",
            f"{where}: only base64 data: URLs (data:image/png;base64,...) are accepted; "
            "the server does not fetch images from the network",
            where,
        )
    try:
        return vision.b64decode_image(url, where)
    except vision.VisionError as e:
        raise HttpError("invalid", str(e), where) from None


def chat_messages(messages: list[MessageIn]) -> tuple[Message, ...]:
    out = []
    for i, m in enumerate(messages):
        out.append(
            Message(
                role=m.role,
                **message_content(m.content, f"messages[{i}]"),
                name=m.name or "",
                tool_call_id=m.tool_call_id or "",
                reasoning=m.reasoning_content or m.reasoning or "",
                tool_calls=tuple(
                    tool_call(c.function.name, c.function.arguments, c.id, c.type)
                    for c in m.tool_calls or []
                ),
            )
        )
    return tuple(out)


def usage(u: dict[str, int]) -> dict[str, Any]:
    return {
        "prompt_tokens": u.get("prompt_tokens", 0),
        "completion_tokens": u.get("completion_tokens", 0),
        "total_tokens": u.get("total_tokens", 0),
        "prompt_tokens_details": {"cached_tokens": u.get("cached_tokens", 0)},
        # (speculative decoding's proposals, as OpenAI counts Predicted Outputs')
        "completion_tokens_details": {
            "reasoning_tokens": u.get("reasoning_tokens", 0),
            "accepted_prediction_tokens": u.get("accepted_draft_tokens", 0),
            "rejected_prediction_tokens": u.get("draft_tokens", 0)
            - u.get("accepted_draft_tokens", 0),
        },
    }


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    # (`refusal`, the refusal's tokens, is required and nullable: never a refusal here)
    return {
        "refusal": None,
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": list(e.token.encode()),
                "top_logprobs": [
                    {"token": s, "logprob": v, "bytes": list(s.encode())} for _, s, v in e.top
                ],
            }
            for e in entries
        ],
    }


def completion_logprobs(entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """The legacy completions shape: parallel lists, text offsets from `offset`."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{s: v for _, s, v in e.top} for e in entries],
        "text_offset": offsets,
    }


def tool_call_deltas(chunk: Chunk) -> list[dict[str, Any]]:
    return [
        {
            "index": c.index,
            "id": c.id,
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in chunk.tool_calls
    ]


def chat_message(whole: Chunk) -> dict[str, Any]:
    # `refusal` and `annotations` are required (nullable) in OpenAI's schema: a model
    # here never refuses by API, and nothing annotates its text.
    message: dict[str, Any] = {
        "role": "assistant",
        "content": whole.text or None,
        "refusal": None,
        "annotations": [],
    }
    if whole.reasoning:
        message["reasoning_content"] = whole.reasoning
    if whole.tool_calls:
        message["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in whole.tool_calls
        ]
    elif message["content"] is None:
        message["content"] = ""
    return message


async def error_events(stream: AsyncIterator[str]) -> AsyncIterator[str]:
    """An error after the stream began becomes an `error` event, then [DONE]."""
    try:
        async for event in stream:
            yield event
    except HttpError as e:
        yield sse(error_body(e))
    yield sse("[DONE]")


# --- routes ---------------------------------------------------------------------------
def router(door: Door) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/models")
    async def models() -> dict[str, Any]:
        served = door.cluster.model_id()
        data = [{"id": served, "object": "model", "created": 0, "owned_by": "mlx-relay"}]
        return {"object": "list", "data": data if served else []}

    @r.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        served = door.check_model(model_id)
        return {"id": served, "object": "model", "created": 0, "owned_by": "mlx-relay"}

    @r.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Any:
        name = door.check_model(body.model)
        if not body.messages:
            raise HttpError("invalid", "messages must not be empty", "messages")
        req = GenerationRequest(
            messages=chat_messages(body.messages),
            max_tokens=body.max_completion_tokens or body.max_tokens,
            sampling=body.params(bool(body.logprobs), body.top_logprobs),
            tools=generation.tools(body.tools),
            tool_choice=body.tool_choice or "",
            chat_template_kwargs=body.chat_template_kwargs or {},
            response_format=body.format(),
            cache_salt=body.cache_salt or "",
        )
        choices = await door.generate_n(req, API, body.n or 1)
        head = Head(f"chatcmpl-{choices.request_id}", "chat.completion.chunk", name)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return choices.response(error_events(_chat_events(choices, head, include_usage)))
        wholes = await choices.collect(request)
        return {
            **head.fields("chat.completion"),
            "choices": [
                {
                    "index": i,
                    "message": chat_message(whole),
                    "logprobs": chat_logprobs(whole.logprobs) if body.logprobs else None,
                    "finish_reason": whole.finish_reason,
                }
                for i, whole in enumerate(wholes)
            ],
            "usage": usage(choices.usage([w.usage or {} for w in wholes])),
        }

    @r.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        name = door.check_model(body.model)
        prompts = body.prompt if isinstance(body.prompt, list) else [body.prompt]
        if not prompts:
            raise HttpError("invalid", "prompt: give a string or a list of them", "prompt")
        if body.echo:
            raise HttpError("invalid", "echo is not supported", "echo")
        top = body.logprobs
        reqs = [
            GenerationRequest(
                prompt=prompt,
                max_tokens=body.max_tokens,
                sampling=body.params(top is not None, top),
                response_format=body.format(),
                cache_salt=body.cache_salt or "",
            )
            for prompt in prompts
        ]
        choices = await door.generate_n(reqs, API, body.n or 1)
        head = Head(f"cmpl-{choices.request_id}", "text_completion", name)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return choices.response(
                error_events(_completion_events(choices, head, include_usage, top is not None))
            )
        wholes = await choices.collect(request)
        return {
            **head.fields(),
            "choices": [
                {
                    "index": i,
                    "text": whole.text,
                    "logprobs": completion_logprobs(whole.logprobs, 0) if top is not None else None,
                    "finish_reason": whole.finish_reason,
                }
                for i, whole in enumerate(wholes)
            ],
            "usage": usage(choices.usage([w.usage or {} for w in wholes])),
        }

    @r.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        door.check_model(body.model)
        if body.messages is not None:
            req = GenerationRequest(
                messages=chat_messages(body.messages), tools=generation.tools(body.tools)
            )
        else:
            req = GenerationRequest(prompt=body.prompt or "")
        prompt = await door.render(req)
        return {
            "tokens": prompt.token_ids,
            "count": len(prompt.token_ids),
            "max_model_len": door.cluster.context_length,
            "prompt": prompt.text,
        }

    @r.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        door.check_model(body.model)
        tokenizer = door.cluster.tokenizer()
        vocab = len(tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise HttpError(
                "invalid", f"token ids outside the vocabulary (0..{vocab - 1}): {bad[:5]}", "tokens"
            )
        return {"prompt": tokenizer.decode(body.tokens)}

    return r


@dataclass
class Head:
    """The fields every object of one answer repeats."""

    id: str
    object: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def fields(self, kind: str = "") -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind or self.object,
            "created": self.created,
            "model": self.model,
        }

    def event(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        return sse({**self.fields(), "choices": choices, **extra})


async def _chat_events(choices: Choices, head: Head, include_usage: bool) -> AsyncIterator[str]:
    def choice(index: int, delta: dict[str, Any], finish: str | None = None, **extra: Any):
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish, **extra}

    usages: list[dict[str, int]] = [{} for _ in choices.outputs]
    for index in range(len(choices.outputs)):
        yield head.event([choice(index, {"role": "assistant", "content": ""})])
    async for index, chunk in choices.merged():
        delta: dict[str, Any] = {}
        if chunk.text:
            delta["content"] = chunk.text
        if chunk.reasoning:
            delta["reasoning_content"] = chunk.reasoning
        if chunk.tool_calls:
            delta["tool_calls"] = tool_call_deltas(chunk)
        extra = {"logprobs": chat_logprobs(chunk.logprobs)} if chunk.logprobs else {}
        if delta or extra or chunk.finish_reason is not None:
            yield head.event([choice(index, delta, chunk.finish_reason, **extra)])
        if chunk.finish_reason is not None:
            usages[index] = chunk.usage or {}
    if include_usage:
        yield head.event([], usage=usage(choices.usage(usages)))


async def _completion_events(
    choices: Choices, head: Head, include_usage: bool, logprobs: bool
) -> AsyncIterator[str]:
    usages: list[dict[str, int]] = [{} for _ in choices.outputs]
    offsets = [0] * len(choices.outputs)
    async for index, chunk in choices.merged():
        if not (chunk.text or chunk.finish_reason is not None or chunk.logprobs):
            continue
        choice = {
            "index": index,
            "text": chunk.text,
            "logprobs": completion_logprobs(chunk.logprobs, offsets[index]) if logprobs else None,
            "finish_reason": chunk.finish_reason,
        }
        offsets[index] += len(chunk.text)
        yield head.event([choice])
        if chunk.finish_reason is not None:
            usages[index] = chunk.usage or {}
    if include_usage:
        yield head.event([], usage=usage(choices.usage(usages)))
