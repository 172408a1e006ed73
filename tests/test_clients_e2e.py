"""Issue 38: the clients people use, their current releases, end to end.

Each SDK and framework (openai, anthropic, ollama, langchain-openai, instructor,
pydantic-ai, openai-agents) makes a plain call, a stream, a structured output and a tool
round trip (a call of a tool, then its result sent back and answered) against a real
2-rank cluster over HTTP: on a tiny random model whose chat template has tools, and (the
exhaustive suite, `make test-all`: minutes of the default model's decoding on 2 cores) on
the default model (SmolLM2, whose chat template ignores tools: the server's fallback
prompt carries them). The fallback prompt is the server's, the same whatever the client:
test_client_compat drives it on the default model through the openai, anthropic and
ollama clients in every `make test`. Tool calls are forced (`tool_choice`, or the framework's
structured output, which forces one) and structured outputs are held to their schema
while sampling, so even a random model answers validly: the tests check the answers'
shape and validity, never their wisdom, and that each is the gRPC door's greedy answer
to the same request (as the framework sent it, where it adds its own schema or tools).
One cluster per model for the whole module.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Annotated, Literal

import anthropic
import httpx
import httpx2
import instructor
import jsonschema
import ollama
import openai
import pytest
from agents import (
    Agent as OpenAIAgent,
)
from agents import (
    ModelBehaviorError,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from api_schemas import check_sse, validate
from conftest import start_cluster, stop_cluster
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import StructuredTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, ConfigDict, Field
from pydantic_ai import Agent, RunContext
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from support import Served
from support import greedy as grpc_greedy
from tiny_models import make_tiny_model

from mlx_relay.launch.local import free_ports
from mlx_relay.protocol import relay_pb2 as pb

pytestmark = pytest.mark.cluster
set_tracing_disabled(True)  # (the agents SDK would send its traces to OpenAI)

ASK = "What is the weather in Paris?"
MAX = 12  # tokens of a free-text answer: enough to see it, short to keep the suite fast


class Weather(BaseModel):
    """What get_weather takes: short and closed (no other keys), so that a call or an
    answer held to this schema ends within a few tokens, whatever the model."""

    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=10)
    unit: Literal["celsius", "fahrenheit"]


WEATHER = {k: v for k, v in Weather.model_json_schema().items() if k != "description"}
City = Annotated[str, Field(max_length=10)]  # (a tool's parameter, bounded as above)


class Forecast(BaseModel):
    """A schema of enums only: Anthropic's SDK moves `maxLength` out of the schema it
    sends (into the description), so a bounded string would not stay bounded."""

    model_config = ConfigDict(extra="forbid")
    unit: Literal["celsius", "fahrenheit"]
    sunny: bool


FORCED = 80  # tokens a forced call or structured answer may take (it ends well before)


def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
    """Current weather in a city."""
    return f"21 degrees {unit} and sunny in {city}"


OPENAI_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": WEATHER,
        "strict": True,
    },
}
RESULT = get_weather("Paris", "celsius")
ANSWERS = {"stop": "stop", "length": "length"}  # (gRPC's finish reasons: OpenAI's are the same)


def _grpc(sdk_cluster, messages: list[dict], max_tokens: int, **request) -> pb.GenerateResponse:
    """The gRPC door's greedy answer to the same chat: what every HTTP door and client must
    give back for it (no client here sets a temperature)."""
    return grpc_greedy(sdk_cluster, messages, max_tokens, **request)


def _openai_call(call_id: str, arguments: str, name: str = "get_weather") -> dict:
    return {"id": call_id, "function": {"name": name, "arguments": arguments}}


def _greedy_call(
    sdk_cluster, messages: list[dict], tools: list[dict] = (OPENAI_TOOL,)
) -> pb.ToolCall:
    """The gRPC door's greedy forced call of get_weather for `messages`, `tools` offered
    (in OpenAI's shape: their text is part of the prompt)."""
    tools_json = json.dumps(list(tools))
    reply = _grpc(sdk_cluster, messages, FORCED, tools_json=tools_json, tool_choice="get_weather")
    assert reply.finish_reason == "tool_calls", reply
    [call] = reply.tool_calls
    return call


# Chat completions fields a client here may send: what _grpc_as_sent carries to the gRPC
# door, and those that leave a greedy answer as it is (no client here sets a sampling field).
SENT = {"model", "messages", "max_tokens", "max_completion_tokens", "tools", "tool_choice",
        "response_format", "stream", "stream_options", "parallel_tool_calls"}  # fmt: skip


def _recording(sent: list[dict], asynchronous: bool = False, http=httpx):
    """An http client for an SDK that keeps the JSON body of every request the SDK sends
    (the request as the framework shaped it: its own schema, tools, prompts) in `sent`;
    `http`: the SDK's httpx (Anthropic's and pydantic-ai's: its fork, httpx2)."""

    def keep(request) -> None:
        if request.content:
            sent.append(json.loads(request.content))

    async def keep_async(request) -> None:
        keep(request)

    if asynchronous:
        return http.AsyncClient(event_hooks={"request": [keep_async]}, timeout=300)
    return http.Client(event_hooks={"request": [keep]}, timeout=300)


def _openai_recording(sdk_cluster) -> tuple[openai.OpenAI, list[dict]]:
    sent: list[dict] = []
    client = openai.OpenAI(
        base_url=sdk_cluster.base + "/v1",
        api_key="none",
        max_retries=0,
        http_client=_recording(sent),
    )
    return client, sent


def _grpc_as_sent(sdk_cluster, body: dict) -> pb.GenerateResponse:
    """The gRPC door's greedy answer to a chat completions request as a client sent it:
    the same messages, tools, tool choice, response format and max tokens."""
    assert set(body) <= SENT, set(body) - SENT
    request = {}
    if body.get("tools"):
        request["tools_json"] = json.dumps(body["tools"])
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        assert choice["type"] == "function", choice
        choice = choice["function"]["name"]
    if choice:
        request["tool_choice"] = choice
    if body.get("response_format"):
        request["response_format_json"] = json.dumps(body["response_format"])
    for m in body["messages"]:
        assert isinstance(m.get("content") or "", str), m  # (parts: not this helper's)
    max_tokens = body.get("max_completion_tokens") or body["max_tokens"]
    return _grpc(sdk_cluster, body["messages"], max_tokens, **request)


def _grpc_responses_as_sent(sdk_cluster, body: dict) -> pb.GenerateResponse:
    """The same for a Responses API request of plain input items and a text format: as a
    chat (the instructions its system message), the format as OpenAI chat's
    response_format."""
    items = body["input"]
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    assert all(isinstance(i["content"], str) and i.get("type", "message") == "message"
               for i in items), items  # fmt: skip
    system = (
        [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    )
    messages = [*system, *({"role": i["role"], "content": i["content"]} for i in items)]
    fmt = {k: v for k, v in body["text"]["format"].items() if k != "type"}
    assert body["text"]["format"]["type"] == "json_schema" and not body.get("tools"), body
    sampled = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty")
    assert all(body.get(k) is None for k in sampled), body  # (greedy, as gRPC's)
    response_format = json.dumps({"type": "json_schema", "json_schema": fmt})
    return _grpc(
        sdk_cluster, messages, body["max_output_tokens"], response_format_json=response_format
    )


def _parsed(reply: pb.GenerateResponse, model: type[BaseModel] = Weather) -> BaseModel:
    """The object the gRPC door's greedy answer holds: its one tool call's arguments (a
    forced call) or else its text."""
    if reply.tool_calls:
        assert reply.finish_reason == "tool_calls", reply
        [call] = reply.tool_calls
        return model.model_validate_json(call.function.arguments)
    assert reply.finish_reason == "stop", reply
    return model.model_validate_json(reply.text)


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("default", marks=[pytest.mark.default_model, pytest.mark.exhaustive]),
        "tiny",
    ],
)
def sdk_cluster(request, tmp_path_factory):
    """The default model: the session's default-model cluster (these tests only ask it
    questions); the tiny one: a cluster of its own."""
    if request.param == "default":
        running, port = request.getfixturevalue("default_cluster")
        model = "default"
    else:
        model = make_tiny_model(tmp_path_factory.mktemp("tools-tiny"), "qwen3", num_layers=4)
        port = free_ports(1)[0]
        logs = tmp_path_factory.mktemp("logs")
        running = start_cluster(model, 2, logs, "--http-address", f"127.0.0.1:{port}")
    sdk_cluster = Served(running, model, [], port)
    sdk_cluster.http.timeout = httpx.Timeout(300)  # (a forced call on a busy machine: minutes)
    yield sdk_cluster
    sdk_cluster.http.close()
    if request.param != "default":
        stop_cluster(running)


def _valid(arguments: str | dict) -> Weather:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, WEATHER)
    return Weather.model_validate(args)


# --- openai: chat completions and the Responses API ---------------------------------------


def test_openai_chat(sdk_cluster):
    client = sdk_cluster.openai
    asked = [{"role": "user", "content": ASK}]
    greedy = _grpc(sdk_cluster, asked, MAX)
    plain = client.chat.completions.create(model=sdk_cluster.model, messages=asked, max_tokens=MAX)
    assert plain.choices[0].finish_reason == greedy.finish_reason
    assert plain.choices[0].message.content == greedy.text
    assert plain.usage.completion_tokens == len(greedy.token_ids)

    chunks = list(
        client.chat.completions.create(
            model=sdk_cluster.model,
            messages=[{"role": "user", "content": ASK}],
            max_tokens=MAX,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-2].choices[0].finish_reason == greedy.finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == greedy.text
    assert chunks[-1].usage.completion_tokens == len(greedy.token_ids) and not chunks[-1].choices

    recording, sent = _openai_recording(sdk_cluster)
    parsed = recording.chat.completions.parse(
        model=sdk_cluster.model,
        messages=[{"role": "user", "content": ASK}],
        response_format=Weather,
        max_tokens=FORCED,
    )
    [body] = sent  # (the schema as the SDK made it strict)
    expected = _grpc_as_sent(sdk_cluster, body)
    assert parsed.choices[0].message.content == expected.text
    assert parsed.choices[0].message.parsed == _parsed(expected)

    called = client.chat.completions.create(
        model=sdk_cluster.model,
        messages=asked,
        tools=[OPENAI_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=FORCED,
    )
    [call] = called.choices[0].message.tool_calls
    args = _valid(call.function.arguments)
    assert call.function.arguments == _greedy_call(sdk_cluster, asked).function.arguments
    history = [
        *asked,
        called.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": get_weather(**args.model_dump())},
    ]
    answered = client.chat.completions.create(
        model=sdk_cluster.model,
        messages=history,
        tools=[OPENAI_TOOL],
        tool_choice="none",
        max_tokens=MAX,
    )
    expected = _grpc(
        sdk_cluster, history, MAX, tools_json=json.dumps([OPENAI_TOOL]), tool_choice="none"
    )
    assert answered.choices[0].finish_reason == expected.finish_reason
    assert answered.choices[0].message.content == expected.text
    assert not answered.choices[0].message.tool_calls


def test_openai_responses(sdk_cluster):
    client = sdk_cluster.openai
    tool = {"type": "function", **OPENAI_TOOL["function"]}
    asked = [{"role": "user", "content": ASK}]
    greedy = _grpc(sdk_cluster, asked, MAX)
    status = {"stop": "completed", "length": "incomplete"}[greedy.finish_reason]
    plain = client.responses.create(model=sdk_cluster.model, input=ASK, max_output_tokens=MAX)
    assert plain.status == status and plain.output[-1].type == "message"
    assert plain.output_text == greedy.text

    # (not `responses.stream`, whose final response must be `completed`, not `incomplete`)
    events = list(
        client.responses.create(
            model=sdk_cluster.model, input=ASK, max_output_tokens=MAX, stream=True
        )
    )
    assert events[-1].type == f"response.{status}"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert events[-1].response.output_text == "".join(deltas) == greedy.text

    recording, sent = _openai_recording(sdk_cluster)
    parsed = recording.responses.parse(
        model=sdk_cluster.model, input=ASK, text_format=Weather, max_output_tokens=FORCED
    )
    [body] = sent
    expected = _grpc_responses_as_sent(sdk_cluster, body)
    assert parsed.output_text == expected.text
    assert parsed.output_parsed == _parsed(expected)

    called = client.responses.create(
        model=sdk_cluster.model,
        input=ASK,
        tools=[tool],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=FORCED,
    )
    [call] = [item for item in called.output if item.type == "function_call"]
    args = _valid(call.arguments)
    assert call.arguments == _greedy_call(sdk_cluster, asked).function.arguments
    answered = client.responses.create(  # (the stored response continued)
        model=sdk_cluster.model,
        previous_response_id=called.id,
        input=[
            {
                "type": "function_call_output",
                "call_id": call.call_id,
                "output": (output := get_weather(**args.model_dump())),
            }
        ],
        tools=[tool],
        tool_choice="none",
        max_output_tokens=MAX,
    )
    assert [item.type for item in answered.output][-1] == "message"
    expected = _grpc(
        sdk_cluster,
        [
            *asked,
            {"role": "assistant", "tool_calls": [_openai_call(call.call_id, call.arguments)]},
            {"role": "tool", "tool_call_id": call.call_id, "content": output},
        ],
        MAX,
        tools_json=json.dumps([OPENAI_TOOL]),
        tool_choice="none",
    )
    assert answered.output_text == expected.text


# --- anthropic ---------------------------------------------------------------------------


def test_anthropic(sdk_cluster):
    client = sdk_cluster.anthropic
    asked = [{"role": "user", "content": ASK}]
    greedy = _grpc(sdk_cluster, asked, MAX)
    stop = {"stop": "end_turn", "length": "max_tokens"}[greedy.finish_reason]
    plain = client.messages.create(model=sdk_cluster.model, max_tokens=MAX, messages=asked)
    assert plain.stop_reason == stop and plain.content[-1].text == greedy.text

    with client.messages.stream(model=sdk_cluster.model, max_tokens=MAX, messages=asked) as stream:
        text = "".join(stream.text_stream)
    assert stream.get_final_message().content[-1].text == text == greedy.text

    sent: list[dict] = []
    recording = anthropic.Anthropic(
        base_url=sdk_cluster.base,
        api_key="none",
        max_retries=0,
        http_client=_recording(sent, http=httpx2),
    )
    parsed = recording.messages.parse(
        model=sdk_cluster.model, max_tokens=FORCED, messages=asked, output_format=Forecast
    )
    [body] = sent  # (the schema as the SDK sent it: in output_config or output_format)
    fmt = (body.get("output_config") or {}).get("format") or body["output_format"]
    schema = {"type": "json_schema", "json_schema": {"name": "Forecast", "schema": fmt["schema"]}}
    expected = _grpc(sdk_cluster, asked, FORCED, response_format_json=json.dumps(schema))
    assert parsed.content[-1].text == expected.text
    assert parsed.parsed_output == _parsed(expected, Forecast)

    tools = [{"name": "get_weather", "description": "Current weather", "input_schema": WEATHER}]
    called = client.messages.create(
        model=sdk_cluster.model,
        max_tokens=FORCED,
        messages=asked,
        tools=tools,
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert called.stop_reason == "tool_use"
    [use] = [b for b in called.content if b.type == "tool_use"]
    args = _valid(use.input)
    as_openai = [
        {"type": "function", "function": {"name": t["name"], "description": t["description"],
                                          "parameters": t["input_schema"]}}
        for t in tools
    ]  # fmt: skip
    assert use.input == json.loads(_greedy_call(sdk_cluster, asked, as_openai).function.arguments)
    answered = client.messages.create(
        model=sdk_cluster.model,
        max_tokens=MAX,
        tools=tools,
        tool_choice={"type": "none"},
        messages=[
            *asked,
            {"role": "assistant", "content": [b.model_dump() for b in called.content]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": use.id,
                        "content": get_weather(**args.model_dump()),
                    }
                ],
            },
        ],
    )
    expected = _grpc(
        sdk_cluster,
        [
            *asked,
            {"role": "assistant", "tool_calls": [_openai_call(use.id, json.dumps(use.input))]},
            {"role": "tool", "tool_call_id": use.id, "content": get_weather(**args.model_dump())},
        ],
        MAX,
        tools_json=json.dumps(as_openai),
        tool_choice="none",
    )
    assert (
        answered.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[expected.finish_reason]
    )
    assert answered.content[-1].text == expected.text


# --- ollama ------------------------------------------------------------------------------


def test_ollama(sdk_cluster):
    client = ollama.Client(host=sdk_cluster.base)
    asked = [{"role": "user", "content": ASK}]
    options = {"num_predict": MAX}
    greedy = _grpc(sdk_cluster, asked, MAX)
    plain = client.chat(model=sdk_cluster.model, messages=asked, options=options)
    assert plain.done and plain.message.content == greedy.text
    assert plain.done_reason == greedy.finish_reason and plain.eval_count == len(greedy.token_ids)

    parts = list(client.chat(model=sdk_cluster.model, messages=asked, options=options, stream=True))
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content for p in parts) == greedy.text

    structured = client.chat(
        model=sdk_cluster.model,
        messages=asked,
        format=WEATHER,
        options={"num_predict": FORCED},
    )
    schema = {"type": "json_schema", "json_schema": {"name": "Weather", "schema": WEATHER}}
    expected = _grpc(sdk_cluster, asked, FORCED, response_format_json=json.dumps(schema))
    assert structured.message.content == expected.text
    assert Weather.model_validate_json(structured.message.content) == _parsed(expected)

    # Ollama has no tool_choice: whatever the model does with the tool is checked, and the
    # round trip is a call and its result in the history.
    # (the tool as ollama's client sends it: its own model of a tool, less `strict`,
    # `maxLength`, `additionalProperties`: the prompt shows that text)
    tool = ollama.Tool.model_validate(OPENAI_TOOL).model_dump(exclude_none=True)
    offered = client.chat(model=sdk_cluster.model, messages=asked, tools=[tool], options=options)
    expected = _grpc(sdk_cluster, asked, MAX, tools_json=json.dumps([tool]))
    assert offered.message.content == expected.text
    assert [(c.function.name, c.function.arguments) for c in offered.message.tool_calls or []] == [
        (c.function.name, json.loads(c.function.arguments)) for c in expected.tool_calls
    ]
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}
    answered = client.chat(
        model=sdk_cluster.model,
        messages=[
            *asked,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": RESULT, "tool_name": "get_weather"},
        ],
        tools=[tool],
        options=options,
    )
    expected = _grpc(
        sdk_cluster,
        [
            *asked,
            {
                "role": "assistant",
                "tool_calls": [_openai_call("", json.dumps(call["function"]["arguments"]))],
            },
            {"role": "tool", "content": RESULT},
        ],
        MAX,
        tools_json=json.dumps([tool]),
    )
    assert answered.done and answered.message.content == expected.text


# --- langchain-openai ----------------------------------------------------------------------


def _langchain(sdk_cluster, max_tokens: int = MAX, sent: list[dict] | None = None) -> ChatOpenAI:
    """LangChain's chat model on the cluster; `sent`: where the requests it sends are kept."""
    return ChatOpenAI(
        model=sdk_cluster.model,
        base_url=sdk_cluster.base + "/v1",
        api_key="none",
        max_tokens=max_tokens,
        max_retries=0,
        http_client=None if sent is None else _recording(sent),
    )


def test_langchain(sdk_cluster):
    chat = _langchain(sdk_cluster)
    greedy = _grpc(sdk_cluster, [{"role": "user", "content": ASK}], MAX)
    reply = chat.invoke(ASK)
    assert reply.content == greedy.text
    assert reply.response_metadata["finish_reason"] == greedy.finish_reason
    chunks = list(chat.stream(ASK))
    assert "".join(c.content for c in chunks) == greedy.text

    sent: list[dict] = []
    forced = _langchain(sdk_cluster, FORCED, sent)
    for method in ("json_schema", "function_calling"):
        del sent[:]
        answer = forced.with_structured_output(Weather, method=method, strict=True).invoke(ASK)
        [body] = sent  # (a response_format, or a tool LangChain names and forces)
        assert answer == _parsed(_grpc_as_sent(sdk_cluster, body)), method

    weather = StructuredTool.from_function(get_weather, args_schema=Weather)
    asked = [HumanMessage(ASK)]
    # (strict: LangChain keeps the schema's `additionalProperties: false` only then)
    called = forced.bind_tools([weather], tool_choice="get_weather", strict=True).invoke(asked)
    [call] = called.tool_calls
    _valid(call["args"])
    sent = convert_to_openai_tool(weather, strict=True)  # (the tool as LangChain sends it)
    asked_ = [{"role": "user", "content": ASK}]
    assert call["args"] == json.loads(_greedy_call(sdk_cluster, asked_, [sent]).function.arguments)
    result = weather.invoke(call)
    assert isinstance(result, ToolMessage) and result.content == get_weather(**call["args"])
    answered = chat.bind_tools([weather], tool_choice="none").invoke([*asked, called, result])
    expected = _grpc(
        sdk_cluster,
        [
            *asked_,
            {
                "role": "assistant",
                "tool_calls": [_openai_call(call["id"], json.dumps(call["args"]))],
            },
            {"role": "tool", "tool_call_id": call["id"], "content": result.content},
        ],
        MAX,
        tools_json=json.dumps([convert_to_openai_tool(weather)]),
        tool_choice="none",
    )
    assert answered.content == expected.text and not answered.tool_calls


# --- instructor ----------------------------------------------------------------------------


def test_instructor(sdk_cluster):
    recording, sent = _openai_recording(sdk_cluster)
    tools = instructor.from_openai(recording, mode=instructor.Mode.TOOLS)
    asked = [{"role": "user", "content": ASK}]
    plain = tools.chat.completions.create(
        model=sdk_cluster.model, messages=asked, response_model=None, max_tokens=MAX
    )
    assert plain.choices[0].message.content == _grpc(sdk_cluster, asked, MAX).text

    del sent[:]
    partials = list(
        tools.chat.completions.create_partial(
            model=sdk_cluster.model, messages=asked, response_model=Weather, max_tokens=FORCED
        )
    )
    [body] = sent
    assert Weather.model_validate(partials[-1].model_dump()) == _parsed(
        _grpc_as_sent(sdk_cluster, body)
    )

    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(recording, mode=mode)
        del sent[:]
        answer = client.chat.completions.create(
            model=sdk_cluster.model,
            messages=asked,
            response_model=Weather,
            max_tokens=FORCED,
            max_retries=0,
        )
        [body] = sent  # (a tool instructor names and forces, or a response_format)
        # (instructor's answer is its own subclass of Weather: the fields compared)
        assert answer.model_dump() == _parsed(_grpc_as_sent(sdk_cluster, body)).model_dump(), mode

    # TOOLS mode is a forced call of a tool named for the model; its result goes back.
    del sent[:]
    answer, completion = tools.chat.completions.create_with_completion(
        model=sdk_cluster.model, messages=asked, response_model=Weather, max_tokens=FORCED
    )
    [call] = completion.choices[0].message.tool_calls
    [body] = sent
    assert answer.model_dump() == _parsed(expected := _grpc_as_sent(sdk_cluster, body)).model_dump()
    assert call.function.arguments == expected.tool_calls[0].function.arguments
    history = [
        *asked,
        {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": get_weather(**answer.model_dump())},
    ]
    answered = tools.chat.completions.create(
        model=sdk_cluster.model, response_model=None, max_tokens=MAX, messages=history
    )
    expected = _grpc(sdk_cluster, history, MAX)
    assert answered.choices[0].finish_reason == expected.finish_reason
    assert answered.choices[0].message.content == expected.text


# --- pydantic-ai -----------------------------------------------------------------------------


@dataclass
class CallFirst(AbstractCapability):
    """Forces a call of `tool` on the run's first step and text after it: a run that
    calls the tool, gets its result and answers, whatever the model would rather do."""

    tool: str

    def get_model_settings(self):
        return lambda ctx: {"tool_choice": [self.tool] if ctx.run_step <= 1 else "none"}


def _pydantic_model(sdk_cluster, sent: list[dict] | None = None) -> OpenAIChatModel:
    """pydantic-ai's model of the cluster; `sent`: where the requests it sends are kept."""
    http = None if sent is None else _recording(sent, asynchronous=True, http=httpx2)
    provider = OpenAIProvider(base_url=sdk_cluster.base + "/v1", api_key="none", http_client=http)
    return OpenAIChatModel(sdk_cluster.model, provider=provider)


def test_pydantic_ai(sdk_cluster):
    model = _pydantic_model(sdk_cluster)
    agent = Agent(model, model_settings={"max_tokens": MAX})
    greedy = _grpc(sdk_cluster, [{"role": "user", "content": ASK}], MAX)
    assert agent.run_sync(ASK).output == greedy.text
    streamed = agent.run_stream_sync(ASK)
    text = "".join(streamed.stream_text(delta=True))
    assert streamed.get_output() == text == greedy.text

    sent: list[dict] = []
    recorded = _pydantic_model(sdk_cluster, sent)
    structured = Agent(recorded, output_type=Weather, model_settings={"max_tokens": FORCED})
    output = structured.run_sync(ASK).output
    [body] = sent  # (its output tool, forced)
    assert output == _parsed(_grpc_as_sent(sdk_cluster, body))

    calls: list[Weather] = []
    tooled = Agent(
        recorded, model_settings={"max_tokens": FORCED}, capabilities=[CallFirst("weather")]
    )

    @tooled.tool
    def weather(ctx: RunContext[None], city: City, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Current weather in a city."""
        calls.append(Weather(city=city, unit=unit))
        return get_weather(city, unit)

    del sent[:]
    run = tooled.run_sync(ASK)
    [calling, answering] = sent  # (the forced call, then the answer to its result)
    assert calls == [_parsed(_grpc_as_sent(sdk_cluster, calling))]
    expected = _grpc_as_sent(sdk_cluster, answering)
    assert not expected.tool_calls and run.output == expected.text
    kinds = [part.part_kind for message in run.all_messages() for part in message.parts]
    assert kinds.count("tool-call") == 1 and kinds.count("tool-return") == 1


# --- openai-agents (the Responses API) -------------------------------------------------------


def _expect_whole_or_cut(greedy: pb.GenerateResponse):
    """What the agents SDK does with the door's answer to a greedy request: a whole one
    (finish "stop") is the run's output; one cut by max_tokens (`response.incomplete`) the
    SDK refuses once read whole, with ModelBehaviorError, and exactly then."""
    if greedy.finish_reason == "stop":
        return contextlib.nullcontext()
    assert greedy.finish_reason == "length", greedy
    return pytest.raises(ModelBehaviorError, match="response.incomplete.*max_output_tokens")


def test_openai_agents(sdk_cluster):
    asyncio.run(_agents(sdk_cluster))  # (one event loop: the SDK's async client is bound to it)


async def _agents(sdk_cluster) -> None:
    answers: list[dict] = []  # (every Responses answer the SDK read, as the door sent it)
    asks: list[dict] = []  # (and every request it sent)

    async def record(reply: httpx.Response) -> None:
        if reply.request.url.path.endswith("/responses"):
            asks.append(json.loads(reply.request.content))
            await reply.aread()
            if reply.headers.get("content-type", "").startswith("application/json"):
                answers.append(reply.json())

    http = httpx.AsyncClient(event_hooks={"response": [record]}, timeout=300)
    client = openai.AsyncOpenAI(
        base_url=sdk_cluster.base + "/v1", api_key="none", max_retries=0, http_client=http
    )
    model = OpenAIResponsesModel(model=sdk_cluster.model, openai_client=client)
    short = ModelSettings(max_tokens=MAX)
    agent = OpenAIAgent(name="plain", instructions="Be brief.", model=model, model_settings=short)
    asked = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}]
    greedy = _grpc(sdk_cluster, asked, MAX)
    with _expect_whole_or_cut(greedy):
        assert (await Runner.run(agent, ASK)).final_output == greedy.text
    [answer] = answers
    text = [p["text"] for item in answer["output"] for p in item.get("content") or []]
    assert "".join(text) == greedy.text
    deltas = []
    streamed = Runner.run_streamed(agent, ASK)
    with _expect_whole_or_cut(greedy):
        async for e in streamed.stream_events():
            if e.type == "raw_response_event" and e.data.type == "response.output_text.delta":
                deltas.append(e.data.delta)
        assert streamed.final_output == greedy.text
    assert "".join(deltas) == greedy.text

    forced = ModelSettings(max_tokens=FORCED)
    typed = OpenAIAgent(name="typed", model=model, model_settings=forced, output_type=Weather)
    output = (await Runner.run(typed, ASK)).final_output
    assert output == _parsed(_grpc_responses_as_sent(sdk_cluster, asks[-1]))

    calls: list[Weather] = []

    @function_tool
    def weather(city: City, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Current weather in a city."""
        calls.append(Weather(city=city, unit=unit))
        return get_weather(city, unit)

    caller = OpenAIAgent(
        name="caller",
        model=model,
        tools=[weather],
        model_settings=ModelSettings(max_tokens=FORCED, tool_choice="weather"),
        tool_use_behavior="stop_on_first_tool",
    )
    called = await Runner.run(caller, ASK)
    assert len(calls) == 1 and called.final_output == get_weather(**calls[0].model_dump())
    answerer = OpenAIAgent(
        name="answerer", model=model, tools=[weather], model_settings=ModelSettings(
            max_tokens=MAX, tool_choice="none")
    )  # fmt: skip
    history = called.to_input_list()
    [call] = [item for item in history if item.get("type") == "function_call"]
    [sent] = asks[-1]["tools"]  # (the tool as the SDK sends it, in the Responses API's shape)
    fields = ("name", "description", "parameters", "strict")  # (as a chat client orders them)
    tool = {"type": "function", "function": {k: sent[k] for k in fields}}
    expected = _grpc(
        sdk_cluster,
        [
            {"role": "user", "content": ASK},
            {
                "role": "assistant",
                "tool_calls": [_openai_call(call["call_id"], call["arguments"], "weather")],
            },
            {"role": "tool", "tool_call_id": call["call_id"], "content": called.final_output},
        ],
        MAX,
        tools_json=json.dumps([tool]),
        tool_choice="none",
    )
    del answers[:]
    with _expect_whole_or_cut(expected):
        answered = await Runner.run(answerer, history)
        assert answered.final_output == expected.text
    [answer] = answers
    text = [p["text"] for item in answer["output"] for p in item.get("content") or []]
    assert "".join(text) == expected.text
    assert len(calls) == 1
    await http.aclose()


# --- every object and event against the API owners' published schemas ----------------------


def _stream(sdk_cluster, kind: str, path: str, body: dict) -> list[dict]:
    reply = sdk_cluster.http.post(path, json={**body, "stream": True})
    assert reply.status_code == 200, reply.text
    return check_sse(kind, reply.text)


def test_openai_shapes(sdk_cluster):
    chat = {"model": sdk_cluster.model, "messages": [{"role": "user", "content": ASK}]}
    forced = {"tools": [OPENAI_TOOL], "tool_choice": "required", "max_tokens": FORCED}
    for extra in ({"max_tokens": 4, "logprobs": True, "top_logprobs": 2}, forced):
        reply = sdk_cluster.http.post("/v1/chat/completions", json={**chat, **extra})
        validate("openai", "CreateChatCompletionResponse", reply.json())
    usage = {"stream_options": {"include_usage": True}}
    for extra in ({"max_tokens": 4, "logprobs": True, **usage}, forced):
        _stream(sdk_cluster, "chat", "/v1/chat/completions", {**chat, **extra})
    text = {"model": sdk_cluster.model, "prompt": ["Once upon", "The sky"], "max_tokens": 3}
    reply = sdk_cluster.http.post("/v1/completions", json={**text, "logprobs": 2})
    validate("openai", "CreateCompletionResponse", reply.json())
    _stream(sdk_cluster, "completions", "/v1/completions", {**text, **usage})
    validate("openai", "ListModelsResponse", sdk_cluster.http.get("/v1/models").json())
    validate("openai", "Model", sdk_cluster.http.get(f"/v1/models/{sdk_cluster.model}").json())
    for path, body in (("/v1/chat/completions", {**chat, "model": "nope"}), ("/v1/nope", {})):
        validate("openai", "ErrorResponse", sdk_cluster.http.post(path, json=body).json())


def test_responses_shapes(sdk_cluster):
    tool = {"type": "function", **OPENAI_TOOL["function"]}
    plain = {
        "model": sdk_cluster.model,
        "input": ASK,
        "max_output_tokens": 4,
        "instructions": "Hi.",
    }
    forced = {"tools": [tool], "tool_choice": "required", "max_output_tokens": FORCED}
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    structured = {"text": {"format": fmt}, "max_output_tokens": FORCED}
    for extra in ({}, forced, structured):
        reply = sdk_cluster.http.post("/v1/responses", json={**plain, **extra}).json()
        validate("openai", "Response", reply)
        retrieved = sdk_cluster.http.get(f"/v1/responses/{reply['id']}").json()
        validate("openai", "Response", retrieved)
        events = _stream(sdk_cluster, "responses", "/v1/responses", {**plain, **extra})
        assert events[-1]["type"] in ("response.completed", "response.incomplete")
    missing = sdk_cluster.http.post("/v1/responses", json={**plain, "previous_response_id": "x"})
    validate("openai", "ErrorResponse", missing.json())


def test_anthropic_shapes(sdk_cluster):
    asked = {"model": sdk_cluster.model, "messages": [{"role": "user", "content": ASK}]}
    tools = [{"name": "get_weather", "input_schema": WEATHER}]
    forced = {"tools": tools, "tool_choice": {"type": "any"}, "max_tokens": FORCED}
    fmt = {"output_config": {"format": {"type": "json_schema", "schema": WEATHER}}}
    for extra in ({"max_tokens": 4}, forced, {**fmt, "max_tokens": FORCED}):
        reply = sdk_cluster.http.post("/v1/messages", json={**asked, **extra})
        validate("anthropic", "Message", reply.json())
        events = _stream(sdk_cluster, "anthropic", "/v1/messages", {**asked, **extra})
        assert [e["type"] for e in events][-2:] == ["message_delta", "message_stop"]
    counted = sdk_cluster.http.post("/v1/messages/count_tokens", json={**asked, "tools": tools})
    validate("anthropic", "CountMessageTokensResponse", counted.json())
    for body in (asked, {**asked, "model": "nope", "max_tokens": 4}):
        validate(
            "anthropic", "ErrorResponse", sdk_cluster.http.post("/v1/messages", json=body).json()
        )


# --- a forced call cut by max_tokens --------------------------------------------------------


def test_forced_call_cut_short(sdk_cluster):
    """A forced call that runs out of tokens comes back as far as it got, on every door:
    OpenAI's partial `tool_calls` (arguments the JSON text so far) with finish_reason
    "length", Anthropic's `tool_use` block (its input what can be read) with stop_reason
    "max_tokens", never the call's markup as text. Greedy, so the cut call is the start
    of the whole one, cut a few tokens before its end (inside the arguments)."""
    client = sdk_cluster.openai
    asked = [{"role": "user", "content": ASK}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    chat = {"model": sdk_cluster.model, "messages": asked, "tools": [OPENAI_TOOL], "temperature": 0}
    whole = client.chat.completions.create(**chat, tool_choice=forced, max_tokens=FORCED)
    assert whole.choices[0].finish_reason == "tool_calls"
    cut = whole.usage.completion_tokens - 3
    assert cut > 8  # (well past the name)

    short = client.chat.completions.create(**chat, tool_choice=forced, max_tokens=cut)
    choice = short.choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith("{")
    validate(
        "openai",
        "CreateChatCompletionResponse",
        sdk_cluster.http.post(
            "/v1/chat/completions", json={**chat, "tool_choice": forced, "max_tokens": cut}
        ).json(),
    )
    chunks = list(
        client.chat.completions.create(**chat, tool_choice="required", max_tokens=cut, stream=True)
    )
    assert chunks[-1].choices[0].finish_reason == "length"
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert [d.function.name for d in deltas] == ["get_weather"]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)

    tools = [{"name": "get_weather", "input_schema": WEATHER}]
    greedy = {"extra_body": {"temperature": 0}}  # (the SDK has no such parameter)
    message = {"model": sdk_cluster.model, "messages": asked, "tools": tools, **greedy}
    for choice_ in ({"type": "tool", "name": "get_weather"}, {"type": "any"}):
        short = sdk_cluster.anthropic.messages.create(
            **message, tool_choice=choice_, max_tokens=cut
        )
        assert short.stop_reason == "max_tokens"
        [use] = short.content
        assert use.type == "tool_use" and use.name == "get_weather"
        assert isinstance(use.input, dict)
    with sdk_cluster.anthropic.messages.stream(
        **message, tool_choice={"type": "any"}, max_tokens=cut
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens" and [b.type for b in final.content] == ["tool_use"]

    tool = {"type": "function", **OPENAI_TOOL["function"]}
    reply = sdk_cluster.http.post(
        "/v1/responses",
        json={
            "model": sdk_cluster.model,
            "input": ASK,
            "tools": [tool],
            "tool_choice": "required",
            "max_output_tokens": cut,
            "temperature": 0,
        },
    ).json()
    validate("openai", "Response", reply)
    assert reply["status"] == "incomplete"
    assert [(i["type"], i["status"]) for i in reply["output"]] == [("function_call", "incomplete")]
