"""Anthropic's Messages API: `/v1/messages` (streaming and not) and `count_tokens`.

Content blocks map onto chat messages: `tool_use` blocks become the assistant's tool
calls, `tool_result` blocks tool messages, `thinking` blocks its reasoning, `image`
blocks with base64 sources the user's images, where they stand among its text. The answer
is built by `MessageStream` from the engine's chunks; a non-streaming answer is the
message that stream builds, its events dropped.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request

from mlx_relay.api.http.common import (
    Door,
    Events,
    HttpError,
    Output,
    fold,
    sampling,
    sse_events,
    tool_call,
)
from mlx_relay.api.http.schemas import Lenient, dumps
from mlx_relay.coordinator import generation
from mlx_relay.coordinator.generation import GenerationRequest
from mlx_relay.coordinator.output import Chunk
from mlx_relay.model import vision
from mlx_relay.text.tool_partial import json_prefix_object

API = "anthropic"
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
DIRECT = {"type": "direct"}


def error_body(e: HttpError) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": str(e)},
        "request_id": None,
    }


class Source(Lenient):
    """An image block's source: base64 data (a url source is refused: nothing is fetched)."""

    type: str
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class Block(Lenient):
    type: str
    source: Source | None = None
    text: str | None = None
    thinking: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None


class Message(Lenient):
    role: str
    content: str | list[Block]


class Tool(Lenient):
    name: str
    description: str = ""
    input_schema: dict[str, Any] = {}


class CountRequest(Lenient):
    model: str
    messages: list[Message]
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountRequest):
    max_tokens: int
    # Structured outputs: {"format": {"type": "json_schema", "schema": {...}}}, enforced
    # as OpenAI's response_format is (output_format: the beta's spelling of the same).
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    # vLLM's: prompts of different salts share no cached prefix (tenants kept apart). Not
    # Anthropic's field; its SDKs send it with extra_body.
    cache_salt: str | None = None

    def generate_request(self) -> GenerationRequest:
        return replace(
            prompt_request(self),
            max_tokens=self.max_tokens,
            cache_salt=self.cache_salt or "",
            response_format=self.response_format(),
            sampling=sampling(
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                stop=self.stop_sequences,
            ),
        )

    def response_format(self) -> dict[str, Any] | None:
        """`output_config.format` as OpenAI's response_format (None for free text)."""
        fmt = (self.output_config or {}).get("format") or self.output_format
        where = "output_config.format" if self.output_config else "output_format"
        if not fmt:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            raise HttpError("invalid", f"{where}.type must be 'json_schema'", where)
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise HttpError("invalid", f"{where}.schema must be a JSON Schema object", where)
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def _text(blocks: str | list[Block] | None, where: str) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    out = []
    for i, b in enumerate(blocks):
        if b.type != "text":
            raise HttpError(
                "invalid",
                f"{where}[{i}] is a {b.type!r} block: this server reads text only here",
                where,
            )
        out.append(b.text or "")
    return "\n".join(out)


def chat_messages(body: CountRequest) -> tuple[generation.Message, ...]:
    out: list[generation.Message] = []
    system = _text(body.system, "system")
    if system:
        out.append(generation.Message(role="system", content=system))
    for i, m in enumerate(body.messages):
        if m.role not in ("user", "assistant"):
            raise HttpError(
                "invalid", f"messages[{i}].role must be 'user' or 'assistant'", "messages"
            )
        blocks = [Block(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        parts, reasoning, calls = vision.MessageParts(), [], []
        for j, b in enumerate(blocks):
            where = f"messages[{i}].content[{j}]"
            if b.type == "text":
                parts.text(b.text or "")
            elif b.type == "image" and m.role == "user":
                parts.image(_image(b, where))
            elif b.type in ("thinking", "redacted_thinking"):
                reasoning.append(b.thinking or "")
            elif b.type == "tool_use" and m.role == "assistant":
                calls.append(tool_call(b.name or "", dumps(b.input or {}), b.id or ""))
            elif b.type == "tool_result" and m.role == "user":
                out.append(
                    generation.Message(
                        role="tool",
                        tool_call_id=b.tool_use_id or "",
                        content=_text(b.content, where),
                    )
                )
            else:
                raise HttpError(
                    "invalid",
                    f"{where} is a {b.type!r} block, which this server does not take in a "
                    f"{m.role} message (documents are not supported; images only in user "
                    "messages)",
                    "messages",
                )
        if parts.texts or parts.images or reasoning or calls:
            out.append(
                generation.Message(
                    role=m.role,
                    **parts.fields(),
                    reasoning="".join(reasoning),
                    tool_calls=tuple(calls),
                )
            )
    return tuple(out)


def _image(block: Block, where: str) -> bytes:
    """An `image` block's file bytes: base64 sources only (the server fetches nothing)."""
    source = block.source
    kind = source.type if source else None
    if source is None or kind != "base64" or not source.data:
        raise HttpError(
            "invalid",
            f"{where}: only base64 image sources are accepted (source.type 'base64' with "
            f"the file's data), not {kind!r}: the server does not fetch images",
            where,
        )
    try:
        return vision.b64decode_image(source.data, f"{where}.source.data")
    except vision.VisionError as e:
        raise HttpError("invalid", str(e), where) from None


def prompt_request(body: CountRequest) -> GenerationRequest:
    """What a Messages request says about the prompt (messages, tools, tool_choice,
    thinking), as the typed request; count_tokens renders just this."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": t.input_schema,
            },
        }
        for t in body.tools or []
    ]
    choice = body.tool_choice or {}
    kind = choice.get("type", "auto")
    tool_choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        tool_choice = str(choice.get("name", ""))
    if tool_choice is None:
        raise HttpError(
            "invalid", f"tool_choice.type {kind!r} is not auto, any, tool or none", "tool_choice"
        )
    return GenerationRequest(
        messages=chat_messages(body),
        tools=generation.tools(tools),
        tool_choice=tool_choice,
        chat_template_kwargs=template_kwargs(body.thinking),
    )


def template_kwargs(thinking: dict[str, Any] | None) -> dict[str, Any]:
    if not thinking:
        return {}
    return {"enable_thinking": thinking.get("type") == "enabled"}


class MessageStream:
    """Content blocks built from chunks, and the stream events that build them."""

    def __init__(self, output: Output, model: str, cached: Callable[[], int]) -> None:
        self.id = f"msg_{output.request_id or uuid.uuid4().hex}"
        self.model = model
        self.input_tokens = len(output.request.prompt_tokens)
        self._cached = cached  # the prompt tokens the engine found in a kept cache, now
        self.cached = 0  # those, once known
        self.started = False
        self.blocks: list[dict[str, Any]] = []
        self.open = ""  # the type of the block being streamed
        self.stop_reason: str | None = None
        self.stop_sequence = ""  # the stop string that ended the answer, if one did
        self.usage: dict[str, int] = {}

    def message(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self.blocks,
            **self.stop(),
            "usage": {
                **self.input_usage(),
                **self.output_usage(),
                "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
                "server_tool_use": None,
                "service_tier": "standard",
                "inference_geo": None,
                "speed": None,  # (one speed here: no mode to name)
            },
            "container": None,
            "diagnostics": None,  # (null when the request asked for none, as here)
        }

    def output_usage(self) -> dict[str, Any]:
        """The answer's tokens, and (anthropic 2.14's `output_tokens_details`) how many of
        them were reasoning: the think block's, delimiters included, as the SDK counts."""
        return {
            "output_tokens": self.usage.get("completion_tokens", 0),
            "output_tokens_details": {"thinking_tokens": self.usage.get("reasoning_tokens", 0)},
        }

    def stop(self) -> dict[str, Any]:
        """Why the answer ended (`stop_details` only explains refusals: none here)."""
        return {
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence or None,
            "stop_details": None,
        }

    def input_usage(self) -> dict[str, int]:
        """The prompt's tokens as Anthropic counts them: `input_tokens` are those not
        read from a cache (reads are `cache_read_input_tokens`; the three add up to the
        prompt). Nothing is written to a cache on request, so creation is 0."""
        prompt = self.usage.get("prompt_tokens", self.input_tokens)
        cached = self.usage.get("cached_tokens", self.cached)
        return {
            "input_tokens": prompt - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
        }

    def start(self) -> Events:
        """Nothing yet: `message_start` waits for the first chunk (the request is then
        running, so its cache hit is known and its usage is the final one's)."""
        return []

    def _start(self, cached: Callable[[], int]) -> Events:
        if self.started:
            return []
        self.started, self.cached = True, cached()
        # (its content is empty, as Anthropic's is: the blocks follow as their own events,
        # and this event is serialized after the same chunk's blocks were added)
        message = {**self.message(), "content": []}
        return [("message_start", {"type": "message_start", "message": message})]

    def failed(self, error: HttpError) -> Events:
        return [*self._start(lambda: 0), ("error", error_body(error))]

    def feed(self, chunk: Chunk) -> Events:
        events = self._start(self._cached)
        if chunk.reasoning:
            events += self._delta("thinking", chunk.reasoning)
        if chunk.text:
            events += self._delta("text", chunk.text)
        for call in chunk.tool_calls:
            events += self._close()
            arguments = json_prefix_object(call.arguments or "{}")
            index = len(self.blocks)
            # (`caller`: called by the model itself, not from a server tool's code)
            # (`toolset_name`: null, the tool is no toolset's member)
            block = {
                "type": "tool_use",
                "id": call.id,
                "name": call.name,
                "caller": DIRECT,
                "toolset_name": None,
            }
            self.blocks.append({**block, "input": arguments})
            start = {**block, "input": {}}
            events.append(
                (
                    "content_block_start",
                    {"type": "content_block_start", "index": index, "content_block": start},
                )
            )
            delta = {"type": "input_json_delta", "partial_json": dumps(arguments)}
            events.append(
                (
                    "content_block_delta",
                    {"type": "content_block_delta", "index": index, "delta": delta},
                )
            )
            events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        if chunk.finish_reason is not None:
            events += self._close()
            self.stop_reason = STOP_REASONS.get(chunk.finish_reason, "end_turn")
            if chunk.stop_sequence:
                self.stop_reason, self.stop_sequence = "stop_sequence", chunk.stop_sequence
            self.usage = dict(chunk.usage or {})
            events.append(
                (
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": {**self.stop(), "container": None},
                        "usage": {
                            **self.input_usage(),
                            **self.output_usage(),
                            "server_tool_use": None,
                        },
                    },
                )
            )
            events.append(("message_stop", {"type": "message_stop"}))
        return events

    def _delta(self, kind: str, text: str) -> Events:
        events = []
        if self.open != kind:
            events += self._close()
            self.open = kind
            block = (
                {"type": "text", "text": "", "citations": None}
                if kind == "text"
                else {
                    "type": "thinking",
                    "thinking": "",
                    "signature": "",
                }
            )
            self.blocks.append(dict(block))
            events.append(
                (
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": len(self.blocks) - 1,
                        "content_block": block,
                    },
                )
            )
        self.blocks[-1][kind] += text
        delta = (
            {"type": "text_delta", "text": text}
            if kind == "text"
            else {
                "type": "thinking_delta",
                "thinking": text,
            }
        )
        events.append(
            (
                "content_block_delta",
                {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta},
            )
        )
        return events

    def _close(self) -> Events:
        if not self.open:
            return []
        self.open = ""
        return [
            ("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})
        ]


def router(door: Door) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Any:
        model = door.check_model(body.model)
        output = await door.generate(body.generate_request(), API)
        cached = functools.partial(door.cluster.cached_tokens, output.request_id)
        stream = MessageStream(output, body.model or model, cached)
        if body.stream:
            return output.response(sse_events(output, stream))
        await fold(output, request, stream)
        return stream.message()

    @r.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountRequest) -> dict[str, int]:
        door.check_model(body.model)
        rendered = await door.render(prompt_request(body))
        return {"input_tokens": len(rendered.token_ids)}

    return r
