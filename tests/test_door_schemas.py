"""Every HTTP door's answers and stream events, every variant, against the owners' schemas.

In process, no ranks: one `Cluster` over a one-rank engine serving a tiny llama scripted
(tests/test_generation.py's `script_model`) to answer a chat with a think block, a little
text and a tool call, so that one request shows every kind of output a door shapes:
reasoning, text and a function call. Each answer and each event is checked against the
published documents vendored in tests/schemas (tests/api_schemas.py): OpenAI's for chat
and completions (and Responses), the Open Responses specification's for `/v1/responses`,
Anthropic's and its current SDK's types for Messages, Ollama's for `/api/*`. Besides the
shapes, each test checks that the variant it asks for is there (a tool call, logprobs,
usage), so that a shape cannot pass by being empty.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from api_schemas import (
    check_ndjson,
    check_sse,
    sse_events,
    validate,
    validate_open_responses_event,
)
from fake_pipeline import FakePipeline
from fastapi.testclient import TestClient
from mlx_lm.utils import load_tokenizer
from scripted import script_model
from tiny_models import make_tiny_model

from mlx_relay.api.cluster import Cluster
from mlx_relay.api.http.app import create_app
from mlx_relay.coordinator.config import EngineConfig
from mlx_relay.coordinator.engine import Engine
from mlx_relay.coordinator.pipeline import Pipeline
from mlx_relay.coordinator.requests import encode_text
from mlx_relay.protocol import header as hdr

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOL = {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}
CHAT_TOOLS = [{"type": "function", "function": TOOL}]
SCRIPT = [
    "<think>",
    "Let",
    "</think>",
    "OK",
    "<tool_call>",
    '{"name": "Paris"}',  # (a bigram script spells no token twice: the grammar completes it)
    "</tool_call>",
]
MAX = 40


@pytest.fixture(scope="module")
def scripted_doors(tmp_path_factory):
    """The HTTP app over a one-rank cluster whose model answers USER with SCRIPT."""
    path = make_tiny_model(tmp_path_factory.mktemp("schemas"), "llama", num_layers=2)
    tokenizer = load_tokenizer(path)
    chat = tokenizer.apply_chat_template(
        USER, tools=CHAT_TOOLS, tokenize=False, add_generation_prompt=True
    )
    end = encode_text(tokenizer, chat)[-1]
    script_model(path, {end: SCRIPT})
    engine = Engine(Pipeline(None, None), EngineConfig(default_max_tokens=MAX))
    engine.start()
    cluster = Cluster(engine, model=str(path))
    cluster.load()
    with TestClient(create_app(cluster)) as http:
        yield http
    engine.call(lambda: mx.eval(mx.random.state)).result()
    cluster.free(shutdown=True)
    engine.join(10)


def _model(http: TestClient) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def _post(http: TestClient, path: str, body: dict) -> dict:
    reply = http.post(path, json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _stream(http: TestClient, path: str, body: dict) -> str:
    reply = http.post(path, json={**body, "stream": True})
    assert reply.status_code == 200, reply.text
    return reply.text


# --- OpenAI chat completions ------------------------------------------------------------

CHAT = {"messages": USER, "max_tokens": MAX, "temperature": 0}


@pytest.mark.parametrize("tools", [False, True], ids=["text", "tools"])
def test_chat_answer_and_stream(scripted_doors, tools):
    body = {**CHAT, **({"tools": CHAT_TOOLS} if tools else {})}
    reply = validate(
        "openai",
        "CreateChatCompletionResponse",
        _post(scripted_doors, "/v1/chat/completions", body),
    )
    message = reply["choices"][0]["message"]
    assert message.get("tool_calls") or not tools, message
    chunks = check_sse("chat", _stream(scripted_doors, "/v1/chat/completions", body))
    assert chunks[-1]["choices"][0]["finish_reason"] == reply["choices"][0]["finish_reason"]


def test_chat_logprobs_usage_and_n(scripted_doors):
    body = {**CHAT, "logprobs": True, "top_logprobs": 2, "n": 2}
    reply = validate(
        "openai",
        "CreateChatCompletionResponse",
        _post(scripted_doors, "/v1/chat/completions", body),
    )
    assert len(reply["choices"]) == 2
    assert all(c["logprobs"]["content"] for c in reply["choices"])
    body["stream_options"] = {"include_usage": True}
    chunks = check_sse("chat", _stream(scripted_doors, "/v1/chat/completions", body))
    assert chunks[-1]["usage"]["completion_tokens"] == reply["usage"]["completion_tokens"]
    assert {c["choices"][0]["index"] for c in chunks if c["choices"]} == {0, 1}
    assert any(c["choices"][0]["logprobs"] for c in chunks if c["choices"])


def test_completions_answer_stream_logprobs_and_n(scripted_doors):
    body = {"prompt": "Paris", "max_tokens": 8, "temperature": 0, "logprobs": 2, "n": 2}
    reply = validate(
        "openai", "CreateCompletionResponse", _post(scripted_doors, "/v1/completions", body)
    )
    assert len(reply["choices"]) == 2 and reply["choices"][0]["logprobs"]["tokens"]
    body["stream_options"] = {"include_usage": True}
    chunks = check_sse("completions", _stream(scripted_doors, "/v1/completions", body))
    assert chunks[-1]["usage"]["completion_tokens"] == reply["usage"]["completion_tokens"]
    plain = {"prompt": "Paris", "max_tokens": 8, "temperature": 0}
    validate("openai", "CreateCompletionResponse", _post(scripted_doors, "/v1/completions", plain))
    check_sse("completions", _stream(scripted_doors, "/v1/completions", plain))


def test_openai_errors_and_models(scripted_doors):
    for path, body in (
        ("/v1/chat/completions", {"messages": []}),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}),
        ("/v1/responses", {"input": "x", "previous_response_id": "resp_none"}),
    ):
        reply = scripted_doors.post(path, json=body)
        assert reply.status_code >= 400, reply.text
        validate("openai", "ErrorResponse", reply.json())
    listed = validate("openai", "ListModelsResponse", scripted_doors.get("/v1/models").json())
    model = listed["data"][0]["id"]
    validate("openai", "Model", scripted_doors.get(f"/v1/models/{model}").json())


# --- Responses: OpenAI's document and the Open Responses specification ------------------

RESPONSES = {"input": USER[0]["content"], "max_output_tokens": MAX, "temperature": 0}
# (no description: the echo must fill in what the specification requires of a tool)
RESPONSES_TOOLS = [{"type": "function", "name": TOOL["name"], "parameters": WEATHER}]


@pytest.mark.parametrize("tools", [False, True], ids=["text", "tools"])
def test_responses_answer_and_every_event(scripted_doors, tools):
    body = {
        **RESPONSES,
        "presence_penalty": 0.5,
        **({"tools": RESPONSES_TOOLS} if tools else {}),
    }
    reply = validate("openai", "Response", _post(scripted_doors, "/v1/responses", body))
    kinds = [item["type"] for item in reply["output"]]
    assert ("function_call" in kinds or not tools) and "message" in kinds, kinds
    assert reply["presence_penalty"] == 0.5  # echoed, not made up
    validate("openai", "Response", scripted_doors.get(f"/v1/responses/{reply['id']}").json())
    events = check_sse("responses", _stream(scripted_doors, "/v1/responses", body))
    types = {e["type"] for e in events}
    assert {"response.created", "response.output_text.delta"} <= types, types
    assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
    assert "response.function_call_arguments.done" in types or not tools, types
    for event in events:
        validate_open_responses_event(event)  # (check_sse did; here it is visible)


def test_responses_reasoning_is_shaped_as_both_documents_say(scripted_doors):
    reply = validate("openai", "Response", _post(scripted_doors, "/v1/responses", RESPONSES))
    assert reply["output"][0]["type"] == "reasoning", reply["output"]
    assert reply["usage"]["output_tokens_details"]["reasoning_tokens"] > 0, reply["usage"]


# --- Anthropic Messages ------------------------------------------------------------------

MESSAGES = {"messages": USER, "max_tokens": MAX, "temperature": 0}


@pytest.mark.parametrize("tools", [False, True], ids=["text", "tools"])
def test_messages_answer_and_stream(scripted_doors, tools):
    body = {
        **MESSAGES,
        "model": _model(scripted_doors),
        **({"tools": [{"name": TOOL["name"], "input_schema": WEATHER}]} if tools else {}),
    }
    reply = validate("anthropic", "Message", _post(scripted_doors, "/v1/messages", body))
    kinds = [block["type"] for block in reply["content"]]
    assert ("tool_use" in kinds or not tools) and "thinking" in kinds, kinds
    assert reply["usage"]["output_tokens_details"]["thinking_tokens"] > 0, reply["usage"]
    events = check_sse("anthropic", _stream(scripted_doors, "/v1/messages", body))
    assert events[-1]["type"] == "message_stop"
    counted = _post(
        scripted_doors, "/v1/messages/count_tokens", {"model": body["model"], "messages": USER}
    )
    validate("anthropic", "CountMessageTokensResponse", counted)
    error = scripted_doors.post("/v1/messages", json={"model": body["model"], "messages": USER})
    assert error.status_code == 400
    validate("anthropic", "ErrorResponse", error.json())


# --- Ollama ------------------------------------------------------------------------------


@pytest.mark.parametrize("tools", [False, True], ids=["text", "tools"])
def test_ollama_chat_answer_and_stream(scripted_doors, tools):
    body = {
        "model": _model(scripted_doors),
        "messages": USER,
        "stream": False,
        "options": {"num_predict": MAX, "temperature": 0},
        **({"tools": CHAT_TOOLS} if tools else {}),
    }
    reply = validate("ollama", "ChatResponse", _post(scripted_doors, "/api/chat", body))
    assert reply["message"].get("tool_calls") or not tools, reply
    lines = check_ndjson("chat", _stream(scripted_doors, "/api/chat", body))
    assert lines[-1]["done_reason"] == reply["done_reason"]


def test_ollama_generate_and_the_listings(scripted_doors):
    body = {
        "model": _model(scripted_doors),
        "prompt": "Paris",
        "stream": False,
        "options": {"num_predict": 8, "temperature": 0},
    }
    reply = validate("ollama", "GenerateResponse", _post(scripted_doors, "/api/generate", body))
    assert reply["done"] is True and reply["eval_count"] > 0
    check_ndjson("generate", _stream(scripted_doors, "/api/generate", body))
    tags = validate("ollama", "ListResponse", scripted_doors.get("/api/tags").json())
    model = tags["models"][0]["name"]
    validate("ollama", "PsResponse", scripted_doors.get("/api/ps").json())
    validate("ollama", "ShowResponse", _post(scripted_doors, "/api/show", {"model": model}))
    validate("ollama", "VersionResponse", scripted_doors.get("/api/version").json())
    missing = scripted_doors.post("/api/show", json={"model": "no-such-model"})
    assert missing.status_code == 404
    validate("ollama", "ErrorResponse", missing.json())


# --- a stream that fails after it began ------------------------------------------------


def _decode_step(step) -> bool:
    return step.header.cmd == hdr.CMD_FORWARD and step.header.group != hdr.NO_GROUP


@pytest.fixture(scope="module")
def failing_doors(tmp_path_factory):
    """(the HTTP app, its pipeline) over a one-rank engine whose pipeline fails the steps
    it is told to (tests/fake_pipeline.py): a rank's failure reaches a stream already
    under way, which must end in its door's own error event."""
    path = make_tiny_model(tmp_path_factory.mktemp("failing"), "llama", num_layers=2)
    pipeline = FakePipeline(depth=1)
    engine = Engine(pipeline, EngineConfig(default_max_tokens=MAX))
    engine.start()
    cluster = Cluster(engine, model=str(path))
    cluster.load()
    with TestClient(create_app(cluster)) as http:
        yield http, pipeline
    cluster.free(shutdown=True)
    engine.join(10)


FAILING = [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": MAX}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": MAX}),
    ("/v1/responses", {"input": "Once upon a time", "max_output_tokens": MAX}),
    ("/v1/messages", {"messages": USER, "max_tokens": MAX}),
    ("/api/chat", {"messages": USER, "options": {"num_predict": MAX}}),
]


@pytest.mark.parametrize(("path", "body"), FAILING, ids=[p for p, _ in FAILING])
def test_a_failed_stream_ends_in_its_doors_error_event(failing_doors, path, body):
    """Rank 1 fails the stream's second decode step: the stream began (status 200, its
    first events sent), so the failure arrives as the door's error event, shaped as its
    owner's document says (OpenAI: an ErrorResponse chunk; Responses: OpenAI's
    ResponseErrorEvent and the Open Responses specification's error event at once;
    Anthropic: its ErrorResponse; Ollama: a line with an error string), saying what failed,
    and is the stream's last event."""
    http, pipeline = failing_doors
    calls = iter(range(2))
    pipeline.fail_step(
        1, "rank 1 lost its cache", lambda s: _decode_step(s) and next(calls, 1) == 1
    )
    if path in ("/api/chat", "/v1/messages"):
        body = {**body, "model": _model(http)}
    if path == "/api/chat":
        reply = http.post(path, json={**body, "stream": True})
        assert reply.status_code == 200, reply.text
        lines = [json.loads(line) for line in reply.text.splitlines() if line.strip()]
        assert len(lines) >= 2 and all("error" not in line for line in lines[:-1]), lines
        assert set(lines[-1]) == {"error"} and "rank 1 lost its cache" in lines[-1]["error"]
        return
    events = sse_events(_stream(http, path, body))
    name, last = events[-1] if events[-1][1] != "[DONE]" else events[-2]
    assert len(events) >= 3, events
    assert "rank 1 lost its cache" in json.dumps(last), last
    if path == "/v1/responses":
        assert name == "error"
        validate("openai", "ResponseErrorEvent", last)
        validate_open_responses_event(last)
        assert last["sequence_number"] == events[-2][1]["sequence_number"] + 1
    elif path == "/v1/messages":
        assert name == "error"
        validate("anthropic", "ErrorResponse", last)
    else:
        validate("openai", "ErrorResponse", last)
