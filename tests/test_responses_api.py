"""OpenAI's Responses API door against the openai SDK's own types and clients: stored
responses continued with `previous_response_id`, the streamed event sequence parsed
event by event with `ResponseStreamEvent`, and the response object with every key its
schema requires. On test_http_api's scripted 2-rank cluster: any chat prompt is answered
`<think>Weather?</think>OK<tool_call>{"name": "get_weather"}</tool_call>`."""

from __future__ import annotations

import json
import typing

import openai
import pytest
from api_schemas import validate, validate_open_responses_event
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from scripted import MESSAGES, TOOLS

from mlx_relay.api.http.responses import Store, Stored

pytestmark = pytest.mark.cluster

ASK = MESSAGES[0]["content"]
FUNCTION_TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}
]
EVENTS = TypeAdapter(ResponseStreamEvent)
# (the union's members by type: their errors name the missing field, the union's don't)
EVENT_TYPES = {
    member.model_fields["type"].annotation.__args__[0]: member
    for member in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}


def _event(data: dict):
    validate("openai", "ResponseStreamEvent", data)  # OpenAI's published schema
    validate_open_responses_event(data)  # and the Open Responses specification's
    EVENT_TYPES[data["type"]].model_validate(data)
    return EVENTS.validate_python(data)


def _create(scripted_http, **fields):
    return scripted_http.openai.responses.create(
        model=scripted_http.model, tools=FUNCTION_TOOLS, max_output_tokens=40, **fields
    )


def test_previous_response_id_continues_the_stored_conversation(scripted_http):
    first = _create(scripted_http, input=ASK, instructions="Answer in French.")
    assert [item.type for item in first.output] == ["reasoning", "message", "function_call"]
    assert first.store is True and first.previous_response_id is None
    call = first.output[2]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}

    # Continued: the stored conversation (not its instructions: this request has none),
    # then the new input ...
    second = _create(scripted_http, previous_response_id=first.id, input=[result])
    assert second.previous_response_id == first.id and second.instructions is None
    # ... is the prompt a client sending the whole conversation itself gets.
    whole = [{"role": "user", "content": ASK}, *(i.model_dump() for i in first.output), result]
    sent = _create(scripted_http, input=whole, store=False)
    assert second.usage.input_tokens == sent.usage.input_tokens
    assert second.usage.input_tokens > first.usage.total_tokens
    # The new request's instructions apply.
    briefed = _create(
        scripted_http, previous_response_id=first.id, input=[result], instructions="Hi."
    )
    assert briefed.usage.input_tokens > second.usage.input_tokens

    # Streamed, the same; and a continued response continues in turn.
    with scripted_http.openai.responses.stream(
        model=scripted_http.model,
        tools=FUNCTION_TOOLS,
        max_output_tokens=40,
        previous_response_id=first.id,
        input=[result],
    ) as stream:
        streamed = stream.get_final_response()
    assert streamed.usage.input_tokens == second.usage.input_tokens
    third = _create(scripted_http, previous_response_id=second.id, input="And tomorrow?")
    assert third.usage.input_tokens > second.usage.total_tokens

    # Stored ones can be fetched and deleted; `store: false` ones are not kept.
    assert scripted_http.openai.responses.retrieve(first.id).output_text == first.output_text
    with pytest.raises(openai.NotFoundError):
        scripted_http.openai.responses.retrieve(sent.id)
    with pytest.raises(openai.NotFoundError) as refused:
        _create(scripted_http, previous_response_id=sent.id, input="Hi")
    assert refused.value.code == "previous_response_not_found"
    scripted_http.openai.responses.delete(third.id)
    with pytest.raises(openai.NotFoundError):
        scripted_http.openai.responses.retrieve(third.id)


def test_an_unknown_previous_response_id_is_openais_404(scripted_http):
    reply = scripted_http.http.post(
        "/v1/responses",
        json={"model": scripted_http.model, "input": "Hi", "previous_response_id": "resp_nope"},
    )
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "previous_response_id"
    assert error["code"] == "previous_response_not_found"
    assert "resp_nope" in error["message"]


def test_the_store_keeps_the_most_recently_used():
    store = Store(size=2)
    for id in ("a", "b"):
        store.put(id, Stored([], {"id": id}))
    store.get("a")  # used: "b" is now the least recent
    store.put("c", Stored([], {"id": "c"}))
    assert list(store.kept) == ["a", "c"]


def _raw_events(scripted_http, **fields) -> list[tuple[str, dict]]:
    body = {
        "model": scripted_http.model,
        "tools": FUNCTION_TOOLS,
        "max_output_tokens": 40,
        **fields,
    }
    events, name = [], None
    with scripted_http.http.stream("POST", "/v1/responses", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: ") :])))
    return events


ITEM_EVENTS = {
    "reasoning": ["response.output_item.added", "response.content_part.added",
                  "response.reasoning_text.delta", "response.reasoning_text.done",
                  "response.content_part.done", "response.output_item.done"],
    "message": ["response.output_item.added", "response.content_part.added",
                "response.output_text.delta", "response.output_text.done",
                "response.content_part.done", "response.output_item.done"],
    "function_call": ["response.output_item.added", "response.function_call_arguments.delta",
                      "response.function_call_arguments.done", "response.output_item.done"],
}  # fmt: skip


def test_streamed_events_are_the_sdks_types_in_its_order(scripted_http):
    events = _raw_events(scripted_http, input=ASK)
    parsed = [_event(data) for _, data in events]
    assert all(name == data["type"] for name, data in events)  # SSE event: = its type
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    # created, in progress, each item's events (deltas collapsed), completed.
    types = [e.type for e in parsed]
    collapsed = [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]]
    expected = ["response.created", "response.in_progress"]
    for kind in ("reasoning", "message", "function_call"):
        expected += ITEM_EVENTS[kind]
    assert collapsed == [*expected, "response.completed"]
    final = parsed[-1].response
    assert final.status == "completed" and final.output_text == "OK"
    assert "".join(e.delta for e in parsed if e.type == "response.output_text.delta") == "OK"
    done = [e.item for e in parsed if e.type == "response.output_item.done"]
    assert [i.model_dump() for i in done] == [i.model_dump() for i in final.output]
    # A response cut short by max_output_tokens ends response.incomplete.
    short = [_event(d) for _, d in _raw_events(scripted_http, input=ASK, **{
        "max_output_tokens": 2})]  # fmt: skip
    assert short[-1].type == "response.incomplete"
    assert short[-1].response.incomplete_details.reason == "max_output_tokens"

    # The SDK's streaming clients see the same sequence and rebuild the same response.
    sdk = list(_create(scripted_http, input=ASK, stream=True))
    assert [e.type for e in sdk] == types
    with scripted_http.openai.responses.stream(
        model=scripted_http.model, tools=FUNCTION_TOOLS, max_output_tokens=40, input=ASK
    ) as stream:
        helped = [e.type for e in stream]
        rebuilt = stream.get_final_response()
    assert helped == types
    assert [i.type for i in rebuilt.output] == ["reasoning", "message", "function_call"]
    assert rebuilt.output_text == "OK" and rebuilt.output[2].name == "get_weather"


def _missing(model_type, raw: dict, where: str = "") -> list[str]:
    """The keys `model_type` requires that `raw` leaves out, nested models included."""
    out = []
    for name, field in model_type.model_fields.items():
        key = field.alias or name
        if key not in raw:
            out += [f"{where}{key}"] if field.is_required() else []
            continue
        value = raw[key]
        sub = field.annotation
        if isinstance(value, dict) and isinstance(sub, type) and hasattr(sub, "model_fields"):
            out += _missing(sub, value, f"{where}{key}.")
    return out


def test_the_response_object_validates_with_every_required_key(scripted_http):
    raw = scripted_http.http.post(
        "/v1/responses",
        json={
            "model": scripted_http.model,
            "input": ASK,
            "tools": FUNCTION_TOOLS,
            "max_output_tokens": 40,
        },
    ).json()
    reply = Response.model_validate(validate("openai", "Response", raw))
    assert _missing(Response, raw) == []
    assert reply.status == "completed" and reply.output_text == "OK"
    for item, parsed in zip(raw["output"], reply.output, strict=True):
        assert _missing(type(parsed), item) == [], item["type"]
    assert _missing(type(reply.usage), raw["usage"]) == []
