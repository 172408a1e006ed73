"""The gRPC door's adapter: the wire's `GenerateRequest` as the typed request.

The proto is this door's wire format only; everything past here reads a
`generation.GenerationRequest`. What the wire spells as JSON text (tools, template
kwargs, response_format) is parsed here, refusals being `InvalidRequest` like every
other check. Sampling options are copied by name: a `SamplingParams` field of the proto
fills the engine's field of the same name, a proto3 zero meaning "left at the default"
(so a new option needs no line here).
"""

from __future__ import annotations

from typing import Any

from mlx_relay.coordinator import generation
from mlx_relay.coordinator.generation import GenerationRequest, Message, ToolCall
from mlx_relay.coordinator.requests import json_field
from mlx_relay.coordinator.sampling import SamplingParams
from mlx_relay.protocol import relay_pb2 as pb


def messages(wire: Any) -> tuple[Message, ...]:
    """`pb.ChatMessage`s as typed messages."""
    return tuple(
        Message(
            role=m.role,
            content=m.content,
            tool_calls=tuple(
                ToolCall(c.function.name, c.function.arguments, c.id, c.type or "function")
                for c in m.tool_calls
            ),
            tool_call_id=m.tool_call_id,
            name=m.name,
            reasoning=m.reasoning,
            images=tuple(m.images),
            image_offsets=tuple(m.image_offsets),
        )
        for m in wire
    )


def sampling(p: pb.SamplingParams) -> SamplingParams:
    """The wire's sampling options by the engine's names (max_tokens is the request's)."""
    options: dict[str, Any] = {}
    for f in p.DESCRIPTOR.fields:
        if f.name == "max_tokens" or f.name not in generation.SAMPLING_FIELDS:
            continue
        value = getattr(p, f.name)
        if f.has_presence:
            if p.HasField(f.name):
                options[f.name] = value
        elif value:  # proto3: zero, empty and false are "not set"
            options[f.name] = dict(value) if f.message_type is not None else value
    if "stop" in options:
        options["stop"] = list(options["stop"])
    return generation.sampling(**options)


def generate_request(request: pb.GenerateRequest) -> GenerationRequest:
    """A `GenerateRequest` as the typed request."""
    p = request.params
    return GenerationRequest(
        prompt=request.prompt_bytes if request.prompt_bytes else request.prompt,
        messages=messages(request.messages),
        max_tokens=p.max_tokens if p.HasField("max_tokens") else None,
        sampling=sampling(p),
        tools=generation.tools(json_field(request.tools_json, "tools", list)),
        tool_choice=request.tool_choice,
        chat_template_kwargs=_kwargs(request.chat_template_kwargs_json),
        response_format=json_field(
            request.response_format_json, "response_format", dict, "a JSON object with a 'type'"
        ),
        grammar=request.grammar,
        request_id=request.request_id,
        cache_salt=request.cache_salt,
    )


def tokenize_request(request: pb.TokenizeRequest) -> GenerationRequest:
    """A `TokenizeRequest` as the request whose prompt it renders."""
    return GenerationRequest(
        prompt=request.text,
        messages=messages(request.messages),
        tools=generation.tools(json_field(request.tools_json, "tools", list)),
        tool_choice=request.tool_choice,
        chat_template_kwargs=_kwargs(request.chat_template_kwargs_json),
    )


def _kwargs(raw: str) -> dict[str, Any]:
    return json_field(raw, "chat_template_kwargs", dict) or {}
