"""OpenAI's Responses API (`POST /v1/responses`): text, images, reasoning, function calls.

`ResponseStream` turns the engine's chunks into the API's output items and the events
that build them; a non-streaming answer is the response that stream completes. Finished
responses (unless `store: false`) stay in memory, the last `STORED` of them, so a request
naming one as `previous_response_id` continues its conversation, and
`GET`/`DELETE /v1/responses/{id}` find it; nothing is written to disk, so a restart
forgets them. `input_image` parts (base64 data: URLs) stay where they are among a
message's text, as on the chat door, whose decoder they share.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from fastapi import APIRouter, Request

from mlx_relay.api.http.common import (
    Door,
    Events,
    HttpError,
    Output,
    fold,
    response_format,
    sampling,
    sse_events,
    tool_call,
)
from mlx_relay.api.http.openai import error_body, image_bytes
from mlx_relay.api.http.schemas import Lenient
from mlx_relay.coordinator import generation
from mlx_relay.coordinator.generation import GenerationRequest, Message
from mlx_relay.coordinator.output import Chunk
from mlx_relay.model import vision

API = "responses"
STORED = 256  # finished responses kept for previous_response_id, the least recent dropped


class Part(Lenient):
    type: str
    text: str | None = None
    image_url: str | None = None  # input_image: a data: URL (http(s) URLs are refused)
    file_id: str | None = None  # input_image from the Files API: refused (nothing is stored)


class Item(Lenient):
    type: str = "message"
    role: str | None = None
    content: str | list[Part] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


class ResponsesRequest(Lenient):
    model: str | None = None
    input: str | list[Item]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None  # not OpenAI's, as vLLM takes it: repeatable sampling
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool = True
    text: dict[str, Any] | None = None
    cache_salt: str | None = None  # vLLM's: no cached prefix shared across salts

    def generate_request(self, before: list[Message] = ()) -> GenerationRequest:
        """The engine's request; `before` is the stored conversation that
        `previous_response_id` names (its instructions not among it: this request's apply)."""
        tools = [_function_tool(i, t) for i, t in enumerate(self.tools or [])]
        choice = self.tool_choice
        if isinstance(choice, dict):
            choice = str(choice.get("name", "")) or "required"
        fmt = (self.text or {}).get("format")
        if fmt and fmt.get("type") == "json_schema":
            schema = {k: v for k, v in fmt.items() if k != "type"}
            fmt = {"type": "json_schema", "json_schema": schema}
        return GenerationRequest(
            messages=tuple(self.messages(before)),
            max_tokens=self.max_output_tokens,
            sampling=sampling(
                temperature=self.temperature,
                top_p=self.top_p,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                seed=self.seed,
            ),
            tools=generation.tools(tools),
            tool_choice=choice or "",
            response_format=response_format(fmt),
            cache_salt=self.cache_salt or "",
        )

    def messages(self, before: list[Message] = ()) -> list[Message]:
        out = [Message(role="system", content=self.instructions)] if self.instructions else []
        return out + conversation(self.items(), list(before))

    def items(self) -> list[Item]:
        return (
            [Item(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        )


def conversation(items: list[Item], out: list[Message]) -> list[Message]:
    """`items` as chat messages, appended to `out` (a conversation so far); reasoning items
    are dropped, as chat templates drop an earlier turn's reasoning."""
    for i, item in enumerate(items):
        if item.type == "message":
            out.append(Message(role=item.role or "user", **_content(item, i)))
        elif item.type == "function_call":
            call = tool_call(item.name or "", item.arguments or "{}", item.call_id or "")
            if out and out[-1].role == "assistant" and not out[-1].content:
                out[-1] = replace(out[-1], tool_calls=(*out[-1].tool_calls, call))
            else:
                out.append(Message(role="assistant", tool_calls=(call,)))
        elif item.type == "function_call_output":
            out.append(
                Message(role="tool", tool_call_id=item.call_id or "", content=item.output or "")
            )
        elif item.type != "reasoning":
            raise HttpError(
                "invalid", f"input[{i}] is a {item.type!r} item, not supported", "input"
            )
    return out


def _content(item: Item, i: int) -> dict[str, Any]:
    """A message item's text and its images where they stand among the text, as
    `Message` fields. A text-only model refuses the images (Cluster.build)."""
    parts = vision.MessageParts()
    if item.content is None or isinstance(item.content, str):
        parts.text(item.content or "")
        return parts.fields()
    for j, part in enumerate(item.content):
        where = f"input[{i}].content[{j}]"
        if part.type in ("input_text", "output_text", "text"):
            parts.text(part.text or "")
        elif part.type == "input_image" and part.image_url:
            parts.image(image_bytes(part.image_url, f"{where}.image_url"))
        elif part.type == "input_image":
            raise HttpError(
                "invalid",
                f"{where}: an input_image needs image_url as a base64 data: URL "
                "(data:image/png;base64,...); file_id is not accepted: the server stores "
                "no files and fetches nothing",
                "input",
            )
        else:
            raise HttpError(
                "invalid",
                f"{where} is a {part.type!r} part: this server reads input_text and "
                "input_image parts only (files and audio are not supported)",
                "input",
            )
    return parts.fields()


@dataclass
class Stored:
    messages: list[Message]  # the conversation, its output included; no instructions
    response: dict[str, Any]


class Store:
    """The last `size` finished responses, for `previous_response_id` (in memory only)."""

    def __init__(self, size: int = STORED) -> None:
        self.size = size
        self.kept: OrderedDict[str, Stored] = OrderedDict()

    def get(self, id: str, param: str = "previous_response_id") -> Stored:
        found = self.kept.get(id)
        if found is None:
            raise HttpError(
                "not_found",
                f"Previous response with id {id!r} not found: this server keeps the last "
                f"{self.size} responses in memory (not those sent with store: false), "
                "and forgets them when it restarts",
                param,
                code="previous_response_not_found"
                if param == "previous_response_id"
                else "response_not_found",
            )
        self.kept.move_to_end(id)
        return found

    def put(self, id: str, stored: Stored) -> None:
        self.kept[id] = stored
        self.kept.move_to_end(id)
        while len(self.kept) > self.size:
            self.kept.popitem(last=False)

    def pop(self, id: str) -> Stored:
        found = self.get(id, "response_id")
        del self.kept[id]
        return found


def _function_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise HttpError("invalid", f"tools[{i}]: only function tools are supported", "tools")
    fields = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fields}


def _echo(body: ResponsesRequest | None) -> dict[str, Any]:
    """What the Responses object repeats of its request: every field OpenAI's schema and
    the Open Responses specification require, as this server applied it (the defaults
    where the request left one out; null where the specification allows it for what this
    server does not do: no cap on tool calls, no safety or cache keys of its own)."""
    body = body or ResponsesRequest(input="")
    extra = body.model_extra or {}
    return {
        "presence_penalty": float(body.presence_penalty or 0.0),
        "frequency_penalty": float(body.frequency_penalty or 0.0),
        "top_logprobs": 0,  # (this door returns no log probabilities)
        "max_tool_calls": None,
        "safety_identifier": _str_or_none(extra.get("safety_identifier")),
        "prompt_cache_key": _str_or_none(extra.get("prompt_cache_key")),
        "instructions": body.instructions,
        "previous_response_id": body.previous_response_id,
        "metadata": {},
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature if body.temperature is not None else 1.0,
        "top_p": body.top_p if body.top_p is not None else 1.0,
        "truncation": "disabled",
        "text": body.text or {"format": {"type": "text"}},
        "tools": [_tool_echo(t) for t in body.tools or []],
        "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": True,
        "reasoning": {"effort": None, "summary": None},
        "store": body.store,
        "background": False,
        "service_tier": "default",
    }


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _tool_echo(tool: dict[str, Any]) -> dict[str, Any]:
    """A request's tool as the response repeats it: a function tool with the fields
    OpenAI's schema and the Open Responses specification require of it (`strict`,
    `parameters` and `description` null where not given)."""
    if tool.get("type") != "function":
        return tool
    return {"strict": None, "parameters": None, "description": None, **tool}


class ResponseStream:
    """Output items built from chunks, and the Responses API's events for them."""

    def __init__(
        self,
        output: Output,
        model: str,
        body: ResponsesRequest | None = None,
        finished: Callable[[ResponseStream], None] | None = None,
    ) -> None:
        self.finished = finished  # called with the finished stream before its last event
        self.id = f"resp_{output.request_id or uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())
        self.completed_at: int | None = None
        self.echo = _echo(body)
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.status = "in_progress"
        self.usage: dict[str, int] = {}
        self.incomplete: dict[str, str] | None = None
        self.seq = 0

    def response(self) -> dict[str, Any]:
        u = self.usage
        response = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": self.status,
            "model": self.model,
            "output": self.items,
            "incomplete_details": self.incomplete,
            "error": None,
            "completed_at": self.completed_at,
            **self.echo,
            "usage": {
                "input_tokens": u.get("prompt_tokens", 0),
                "input_tokens_details": {
                    "cached_tokens": u.get("cached_tokens", 0),
                    "cache_write_tokens": 0,
                },
                "output_tokens": u.get("completion_tokens", 0),
                "output_tokens_details": {"reasoning_tokens": u.get("reasoning_tokens", 0)},
                "total_tokens": u.get("total_tokens", 0),
            },
        }
        if not u:  # (not known until the end: null, as OpenAI's API and Open Responses send it)
            response["usage"] = None
        return response

    def _event(self, kind: str, **fields: Any) -> tuple[str, dict[str, Any]]:
        self.seq += 1
        return kind, {"type": kind, "sequence_number": self.seq - 1, **fields}

    def start(self) -> Events:
        return [
            self._event("response.created", response=self.response()),
            self._event("response.in_progress", response=self.response()),
        ]

    def failed(self, error: HttpError) -> Events:
        """The stream's error event, in both documents' shapes at once: OpenAI's puts the
        error's code, message and param on the event, the Open Responses specification
        nests the whole error (its type too) under `error`."""
        self.status = "failed"
        payload = error_body(error)["error"]
        fields = {k: payload[k] for k in ("code", "message", "param")}
        return [self._event("error", **fields, error=payload)]

    def feed(self, chunk: Chunk) -> Events:
        events = []
        if chunk.reasoning:
            events += self._text("reasoning", chunk.reasoning)
        if chunk.text:
            events += self._text("message", chunk.text)
        for call in chunk.tool_calls:
            events += self._close()
            item = {
                "type": "function_call",
                "id": f"fc_{call.id}",
                "call_id": call.id,
                "name": call.name,
                "arguments": call.arguments,
                "status": "completed" if call.complete else "incomplete",
            }
            index = len(self.items)
            self.items.append(item)
            events.append(
                self._event(
                    "response.output_item.added",
                    output_index=index,
                    item={**item, "arguments": "", "status": "in_progress"},
                )
            )
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=call.arguments,
                )
            )
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=call.name,
                    arguments=call.arguments,
                )
            )
            events.append(self._event("response.output_item.done", output_index=index, item=item))
        if chunk.finish_reason is not None:
            events += self._close()
            self.usage = dict(chunk.usage or {})
            if chunk.finish_reason == "length":
                self.status = "incomplete"
                self.incomplete = {"reason": "max_output_tokens"}
            else:
                self.status = "completed"
                self.completed_at = int(time.time())
            if self.finished is not None:  # (stored before the client hears it is done)
                self.finished(self)
            events.append(self._event(f"response.{self.status}", response=self.response()))
        return events

    def _text(self, kind: str, text: str) -> Events:
        events = []
        part_type = "output_text" if kind == "message" else "reasoning_text"
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            item_id = f"{'msg' if kind == 'message' else 'rs'}_{uuid.uuid4().hex[:16]}"
            if kind == "message":
                item = {
                    "type": "message",
                    "id": item_id,
                    "status": "in_progress",
                    "role": "assistant",
                    "content": [],
                }
            else:
                item = {"type": "reasoning", "id": item_id, "summary": [], "content": []}
            self.open = item
            self.items.append(item)
            index = len(self.items) - 1
            events.append(
                self._event(
                    "response.output_item.added", output_index=index, item=dict(item, content=[])
                )
            )
            part = {"type": part_type, "text": ""} | (
                {"annotations": [], "logprobs": []} if kind == "message" else {}
            )
            item["content"].append(part)
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    part=dict(part),
                )
            )
        item = self.open
        item["content"][0]["text"] += text
        index = len(self.items) - 1
        delta_kind = (
            "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        )
        fields = {"logprobs": []} if kind == "message" else {}
        events.append(
            self._event(
                delta_kind,
                item_id=item["id"],
                output_index=index,
                content_index=0,
                delta=text,
                **fields,
            )
        )
        return events

    def _close(self) -> Events:
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.items) - 1
        part = item["content"][0]
        kind = "output_text" if item["type"] == "message" else "reasoning_text"
        if item["type"] == "message":
            item["status"] = "completed"
        return [
            self._event(
                f"response.{kind}.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
                **({"logprobs": []} if item["type"] == "message" else {}),
            ),
            self._event(
                "response.content_part.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]


def router(door: Door) -> APIRouter:
    r = APIRouter()
    store = Store()

    @r.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request) -> Any:
        model = door.check_model(body.model)
        before = store.get(body.previous_response_id).messages if body.previous_response_id else []
        generate = body.generate_request(before)
        output = await door.generate(generate, API)

        def finished(stream: ResponseStream) -> None:
            if body.store:
                asked = generate.messages[1:] if body.instructions else generate.messages
                answer = [Item.model_validate(item) for item in stream.items]
                messages = conversation(answer, list(asked))
                store.put(stream.id, Stored(messages, stream.response()))

        stream = ResponseStream(output, model, body, finished)
        if body.stream:
            return output.response(sse_events(output, stream))
        await fold(output, request, stream)
        return stream.response()

    @r.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> Any:
        return store.get(response_id, "response_id").response

    @r.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> Any:
        store.pop(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return r
