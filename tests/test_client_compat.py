"""Issue 38: what a new user's clients meet on the default model, through the real SDKs.

One 2-rank cluster of the embedded default model (SmolLM2, whose chat template ignores
tools) with its HTTP doors: tools work through the fallback prompt, forced calls are
held to a grammar (a well-formed call of an allowed tool, arguments valid against its
schema), and the response objects validate against the SDKs' own types.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from conftest import assert_gone, start_cluster

from mlx_relay.launch.local import free_ports

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


class Served:
    def __init__(self, running, port: int) -> None:
        self.running = running
        self.base = f"http://127.0.0.1:{port}"
        self.openai = openai.OpenAI(base_url=self.base + "/v1", api_key="none", max_retries=0)
        self.anthropic = anthropic.Anthropic(base_url=self.base, api_key="none", max_retries=0)
        self.http = httpx.Client(base_url=self.base, timeout=120)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    port = free_ports(1)[0]
    running = start_cluster(
        "default", 2, tmp_path_factory.mktemp("logs"), "--http-address", f"127.0.0.1:{port}"
    )
    served = Served(running, port)
    yield served
    served.http.close()
    running.stop()
    assert_gone(running.pids)


def _valid_call(name: str, arguments: str | dict) -> dict:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, SCHEMAS[name])
    return args


# --- 2: tools on a model whose template ignores them -------------------------------------


def test_tools_go_into_the_system_prompt_where_the_template_ignores_them(served):
    reply = served.openai.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, max_tokens=60, temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    for call in choice.message.tool_calls or []:
        _valid_call(call.function.name, call.function.arguments)
    shown = served.http.post(
        "/v1/messages/count_tokens",
        json={
            "model": "default",
            "messages": ASK,
            "tools": [
                {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                for t in TOOLS
            ],
        },
    )
    assert shown.status_code == 200, shown.text
    bare = served.anthropic.messages.count_tokens(model="default", messages=ASK)
    assert shown.json()["input_tokens"] > bare.input_tokens + 50  # the tools are in it


def test_a_tool_round_trip_renders(served):
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
    reply = served.openai.chat.completions.create(
        model="default", messages=messages, tools=TOOLS, max_tokens=30, temperature=0
    )
    assert reply.choices[0].message.content or reply.choices[0].message.tool_calls


# --- 3: forced calls are constrained ----------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_openai_required_and_named_calls_are_well_formed(served, temperature):
    for choice, allowed in [
        ("required", {"get_weather", "get_time"}),
        ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
    ]:
        reply = served.openai.chat.completions.create(
            model="default",
            messages=ASK,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=120,
            temperature=temperature,
            seed=3,
        )
        out = reply.choices[0]
        assert out.finish_reason == "tool_calls", out
        assert not out.message.content
        [call] = out.message.tool_calls
        assert call.function.name in allowed
        _valid_call(call.function.name, call.function.arguments)


def test_openai_forced_call_streams(served):
    stream = served.openai.chat.completions.create(
        model="default",
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


def test_anthropic_any_and_named_tool_are_well_formed(served):
    tools = [
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS
    ]
    for choice, allowed in [
        ({"type": "any"}, {"get_weather", "get_time"}),
        ({"type": "tool", "name": "get_weather"}, {"get_weather"}),
    ]:
        message = served.anthropic.messages.create(
            model="default", max_tokens=120, messages=ASK, tools=tools, tool_choice=choice
        )
        assert message.stop_reason == "tool_use"
        [use] = [b for b in message.content if b.type == "tool_use"]
        assert use.name in allowed
        _valid_call(use.name, use.input)


def test_ollama_tools_answer(served):
    reply = served.http.post(
        "/api/chat",
        json={
            "model": "default",
            "messages": ASK,
            "tools": TOOLS,
            "stream": False,
            "options": {"num_predict": 40, "temperature": 0},
        },
    )
    assert reply.status_code == 200, reply.text
    for call in reply.json()["message"].get("tool_calls") or []:
        _valid_call(call["function"]["name"], call["function"]["arguments"])
