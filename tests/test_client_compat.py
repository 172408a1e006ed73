"""Issue 38: what a new user's clients meet on the default model, through the real SDKs.

The embedded default model (SmolLM2, whose chat template ignores tools) on 2 ranks with
its HTTP doors: tools work through the fallback prompt, forced calls are held to a
grammar (a well-formed call of an allowed tool, arguments valid against its schema), and
the response objects validate against the SDKs' own types.

The tools tests run on a tiny random llama wearing SmolLM2's own tokenizer and chat
template (`templated`): what they check (the fallback prompt, the grammar, the
doors' call shapes) comes from the template and the tokenizer alone, and a tools prompt
is some 280 tokens, which the default model prefills at a few tokens a second on 2
cores (minutes for this file; seconds on the tiny one). The rest ask the session's
default-model cluster itself.
"""

from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import psutil
import pytest
from anthropic.types import Message
from conftest import start_cluster, stop_cluster
from openai.types.chat import ChatCompletion
from support import Served, chat_messages, greedy
from tiny_models import make_tiny_model

from mlx_relay.launch.local import free_ports
from mlx_relay.model.default_model import resolve_model
from mlx_relay.protocol import relay_pb2 as pb

pytestmark = [pytest.mark.cluster, pytest.mark.default_model]

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 12}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER,
            "strict": True,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Current time", "parameters": TIME},
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def default_served(default_cluster):
    """test_http_api's Served, on the session's default-model cluster (these tests only
    ask it questions)."""
    running, port = default_cluster
    served = Served(running, "default", [], port)
    yield served
    served.http.close()


# The default model's tokenizer and template files, and the config keys that go with them.
SMOL_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SMOL_IDS = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")


@pytest.fixture(scope="module")
def templated(tmp_path_factory):
    """A tiny random llama with SmolLM2's tokenizer, chat template and special ids, on 2
    ranks with the HTTP doors: the default model as the tools path meets it."""
    smol = resolve_model("default")
    config = json.loads((smol / "config.json").read_text())
    overrides = tuple((key, config[key]) for key in SMOL_IDS)
    path = make_tiny_model(
        tmp_path_factory.mktemp("smol-templated"), "llama", num_layers=4, overrides=overrides
    )
    for name in SMOL_FILES:
        shutil.copy(smol / name, path / name)
    port = free_ports(1)[0]
    logs = tmp_path_factory.mktemp("logs")
    running = start_cluster(path, 2, logs, "--http-address", f"127.0.0.1:{port}")
    served = Served(running, path, [], port)
    yield served
    served.http.close()
    stop_cluster(running)


def _same_as_grpc(choice, expected) -> None:
    """An OpenAI chat choice is the gRPC door's greedy answer to the same request: its
    finish reason, text and tool calls (each valid against its tool's schema)."""
    assert choice.finish_reason == expected.finish_reason
    assert (choice.message.content or "") == expected.text
    calls = [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []
    ]
    assert calls == [
        (c.function.name, json.loads(c.function.arguments)) for c in expected.tool_calls
    ]
    for name, args in calls:
        _valid_call(name, args)


def _valid_call(name: str, arguments: str | dict) -> dict:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, SCHEMAS[name])
    return args


# --- 2: tools on a model whose template ignores them -------------------------------------


def test_tools_go_into_the_system_prompt_where_the_template_ignores_them(templated):
    reply = templated.openai.chat.completions.create(
        model=templated.model, messages=ASK, tools=TOOLS, max_tokens=16, temperature=0
    )
    _same_as_grpc(reply.choices[0], greedy(templated, ASK, 16, tools_json=json.dumps(TOOLS)))
    shown = templated.http.post(
        "/v1/messages/count_tokens",
        json={
            "model": templated.model,
            "messages": ASK,
            "tools": [
                {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                for t in TOOLS
            ],
        },
    )
    assert shown.status_code == 200, shown.text
    bare = templated.anthropic.messages.count_tokens(model=templated.model, messages=ASK)
    assert shown.json()["input_tokens"] > bare.input_tokens + 50  # the tools are in it


def test_a_tool_round_trip_renders(templated):
    """The call and its result come back as history the fallback rewrites as text."""
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    reply = templated.openai.chat.completions.create(
        model=templated.model, messages=messages, tools=TOOLS, max_tokens=30, temperature=0
    )
    expected = greedy(templated, messages, 30, tools_json=json.dumps(TOOLS))
    _same_as_grpc(reply.choices[0], expected)
    # (and the history is in the prompt: without it, another answer)
    assert (
        reply.usage.prompt_tokens
        > greedy(templated, ASK, 1, tools_json=json.dumps(TOOLS)).usage.prompt_tokens
    )


# --- 3: forced calls are constrained ----------------------------------------------------


def test_openai_required_and_named_calls_are_well_formed(templated):
    """Sampled (temperature 1, seeded), so the grammar, not the model's preference, makes
    the call well formed; the call is the gRPC door's to the same seeded request."""
    for choice, allowed, grpc_choice in [
        ("required", {"get_weather", "get_time"}, "required"),
        ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}, "get_time"),
    ]:
        reply = templated.openai.chat.completions.create(
            model=templated.model,
            messages=ASK,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=80,
            temperature=1.0,
            seed=3,
        )
        out = reply.choices[0]
        assert out.finish_reason == "tool_calls", out
        assert not out.message.content
        [call] = out.message.tool_calls
        assert call.function.name in allowed
        _valid_call(call.function.name, call.function.arguments)
        expected = templated.running.client.generate(
            pb.GenerateRequest(
                messages=chat_messages(ASK),
                params=pb.SamplingParams(max_tokens=80, temperature=1.0, seed=3),
                tools_json=json.dumps(TOOLS),
                tool_choice=grpc_choice,
            )
        )
        _same_as_grpc(out, expected)


def test_openai_forced_call_streams(templated):
    stream = templated.openai.chat.completions.create(
        model=templated.model,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=120,
        stream=True,
    )
    calls, finish = {}, None
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert finish == "tool_calls"
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    _valid_call("get_weather", calls[0]["arguments"])
    expected = greedy(templated, ASK, 120, tools_json=json.dumps(TOOLS), tool_choice="get_weather")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in expected.tool_calls
    ]


def test_anthropic_any_and_named_tool_are_well_formed(templated):
    tools = [
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS
    ]
    # (the tools as the door offers them: OpenAI's shape, no description given)
    as_openai = [
        {"type": "function", "function": {"name": t["name"], "description": "",
                                          "parameters": t["input_schema"]}}
        for t in tools
    ]  # fmt: skip
    for choice, allowed, grpc_choice in [
        ({"type": "any"}, {"get_weather", "get_time"}, "required"),
        ({"type": "tool", "name": "get_weather"}, {"get_weather"}, "get_weather"),
    ]:
        message = templated.anthropic.messages.create(
            model=templated.model, max_tokens=120, messages=ASK, tools=tools, tool_choice=choice
        )
        assert message.stop_reason == "tool_use"
        [use] = [b for b in message.content if b.type == "tool_use"]
        assert use.name in allowed
        _valid_call(use.name, use.input)
        expected = greedy(
            templated, ASK, 120, tools_json=json.dumps(as_openai), tool_choice=grpc_choice
        )
        assert [(b.name, b.input) for b in message.content if b.type == "tool_use"] == [
            (c.function.name, json.loads(c.function.arguments)) for c in expected.tool_calls
        ]
        assert "".join(b.text for b in message.content if b.type == "text") == expected.text


def test_ollama_tools_answer(templated):
    reply = templated.http.post(
        "/api/chat",
        json={
            "model": templated.model,
            "messages": ASK,
            "tools": TOOLS,
            "stream": False,
            "options": {"num_predict": 40, "temperature": 0},
        },
    )
    assert reply.status_code == 200, reply.text
    message = reply.json()["message"]
    expected = greedy(templated, ASK, 40, tools_json=json.dumps(TOOLS))
    assert message["content"] == expected.text
    calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []
    ]
    assert calls == [
        (c.function.name, json.loads(c.function.arguments)) for c in expected.tool_calls
    ]
    for name, args in calls:
        _valid_call(name, args)


# --- 5: the smaller items ----------------------------------------------------------------


def test_json_without_content_type_and_unknown_urls(templated):
    body = json.dumps({"model": templated.model, "messages": ASK, "stream": False,
                       "options": {"num_predict": 2}})  # fmt: skip
    expected = greedy(templated, ASK, 2).text
    for headers in ({}, {"Content-Type": "application/x-www-form-urlencoded"}):
        reply = httpx.post(templated.base + "/api/chat", content=body, headers=headers, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["message"]["content"] == expected  # (the body read as JSON)
    missing = templated.http.post("/v1/nothing-here", json={})
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] != "model_not_found"
    assert "Invalid URL" in missing.json()["error"]["message"]


def test_completions_take_a_list_of_prompts(templated):
    reply = templated.openai.completions.create(
        model=templated.model, prompt=["Once upon a time", "The sky is"], max_tokens=3
    )
    assert [c.index for c in reply.choices] == [0, 1]
    for choice, prompt in zip(reply.choices, ("Once upon a time", "The sky is"), strict=True):
        request = pb.GenerateRequest(prompt=prompt, params=pb.SamplingParams(max_tokens=3))
        assert choice.text == templated.running.client.generate(request).text
    one = templated.openai.completions.create(
        model=templated.model, prompt="The sky is", max_tokens=3
    )
    assert reply.choices[1].text == one.choices[0].text
    assert reply.usage.prompt_tokens > one.usage.prompt_tokens


def test_ollama_load_ping_ps_and_tags(default_served):
    served = default_served
    ping = served.http.post("/api/chat", json={"model": "default", "messages": []})
    assert ping.status_code == 200 and ping.json()["done_reason"] == "load"
    [tag] = served.http.get("/api/tags").json()["models"]
    assert tag["size"] > 50_000_000 and len(tag["digest"]) == 64
    assert tag["details"]["parameter_size"].endswith("M")  # SmolLM2-135M
    [running] = served.http.get("/api/ps").json()["models"]
    assert running["size"] == tag["size"] and running["digest"] == tag["digest"]


def test_status_byte_counts_are_numbers(templated):
    """Each rank's rss_bytes is a JSON number, and that rank process's resident memory as
    the OS reports it (read here a moment later: within a factor of 2)."""
    status = templated.http.get("/v1/status").json()
    rss = {r["pid"]: r["rss_bytes"] for r in status["ranks"]}
    assert sorted(rss) == sorted(templated.running.pids)
    for pid, reported in rss.items():
        assert isinstance(reported, int)
        now = psutil.Process(pid).memory_info().rss
        assert now / 2 < reported < now * 2, (pid, reported, now)


# --- 4: shapes, against the SDKs' own types -------------------------------------------------


def _has(raw: dict, *keys: str) -> None:
    missing = [k for k in keys if k not in raw]
    assert not missing, f"missing {missing} in {raw}"


def test_chat_completion_shape(templated):
    raw = templated.http.post(
        "/v1/chat/completions",
        json={"model": templated.model, "messages": ASK, "max_tokens": 4},
    ).json()
    ChatCompletion.model_validate(raw)
    _has(raw, "id", "object", "created", "model", "choices", "usage")
    _has(raw["choices"][0], "index", "message", "finish_reason", "logprobs")
    _has(raw["choices"][0]["message"], "role", "content", "refusal", "annotations")
    assert raw["choices"][0]["message"]["refusal"] is None
    assert raw["choices"][0]["message"]["annotations"] == []


def test_anthropic_message_shape_and_cache_counts(templated):
    request = {"model": templated.model, "max_tokens": 4, "messages": ASK}
    templated.http.post("/v1/messages", json=request)  # the prompt is kept for the next
    raw = templated.http.post("/v1/messages", json=request).json()
    Message.model_validate(raw)
    _has(raw, "id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage")
    _has(raw["content"][0], "type", "text", "citations")
    usage = raw["usage"]
    _has(usage, "input_tokens", "output_tokens", "cache_creation_input_tokens",
         "cache_read_input_tokens", "cache_creation", "server_tool_use", "service_tier")  # fmt: skip
    prompt = templated.anthropic.messages.count_tokens(
        model=templated.model, messages=ASK
    ).input_tokens
    assert usage["cache_read_input_tokens"] > 0  # the second time, the prompt is cached
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == prompt
    with templated.anthropic.messages.stream(**request) as stream:
        events = list(stream)
    start = next(e for e in events if e.type == "message_start").message.usage
    assert start.cache_read_input_tokens == usage["cache_read_input_tokens"]
    assert start.input_tokens == usage["input_tokens"]


def test_anthropic_output_config_format_is_enforced(templated):
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 16}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    raw = templated.http.post(
        "/v1/messages",
        json={
            "model": templated.model,
            "max_tokens": 40,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "output_config": {"format": {"type": "json_schema", "schema": schema}},
        },
    ).json()
    jsonschema.validate(json.loads(raw["content"][0]["text"]), schema)


def test_responses_object_carries_its_required_fields(templated):
    from openai.types.responses import Response

    required = ("id", "object", "created_at", "model", "output", "status", "completed_at",
                "instructions", "previous_response_id", "truncation", "text", "tools",
                "tool_choice", "parallel_tool_calls", "usage", "error", "incomplete_details")  # fmt: skip
    raw = templated.http.post(
        "/v1/responses",
        json={
            "model": templated.model,
            "input": "Hi",
            "instructions": "Be brief.",
            "max_output_tokens": 4,
        },  # fmt: skip
    ).json()
    Response.model_validate(raw)
    _has(raw, *required)
    assert raw["instructions"] == "Be brief."
    with templated.openai.responses.stream(
        model=templated.model, input="Hi", max_output_tokens=4
    ) as s:
        events = list(s)
    assert events[0].type == "response.created"
    for event in (events[0], events[-1]):  # created, and completed or incomplete
        _has(event.response.model_dump(), *required)
