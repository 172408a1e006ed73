"""Issue 38: under tool_choice auto a call the model opens is held to the call grammar.

One 2-rank cluster of a scripted tiny model (tests/test_generation.py's `script_model`:
greedy decoding spells a fixed text) with a tool-aware template, through gRPC and the
OpenAI, Anthropic and Ollama doors. The script answers "OK", opens `<tool_call>` and
calls a tool the request does not offer ("Paris", as issue 38 saw, no arguments): text and the marker
are free (mlx-lm's own tokens), then the grammar holds the call to the one tool offered,
with arguments valid against its strict schema.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from conftest import start_cluster, stop_cluster
from mlx_lm.utils import load_tokenizer
from oracle import chat_tokens, mlx_lm_tokens
from scripted import MESSAGES, script_model
from support import Served, chat_messages
from tiny_models import make_tiny_model

from mlx_relay.coordinator.requests import encode_text
from mlx_relay.launch.local import free_ports
from mlx_relay.protocol import relay_pb2 as pb

pytestmark = pytest.mark.cluster

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": WEATHER, "strict": True},
    }
]
SCRIPT = ["OK", "<tool_call>", '{"name": "Paris"}', "</tool_call>"]
MAX_TOKENS = 80


@pytest.fixture(scope="module")
def auto_scripted(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("auto"), "llama", num_layers=3)
    tokenizer = load_tokenizer(path)
    chat = tokenizer.apply_chat_template(
        MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    end = encode_text(tokenizer, chat)[-1]
    script = script_model(path, {end: SCRIPT})[end]
    assert mlx_lm_tokens(path, chat_tokens(path, MESSAGES, tools=TOOLS), 40) == script
    port = free_ports(1)[0]
    running = start_cluster(
        path, 2, tmp_path_factory.mktemp("logs"), "--http-address", f"127.0.0.1:{port}"
    )
    auto_scripted = Served(running, path, script, port)
    yield auto_scripted
    auto_scripted.http.close()
    stop_cluster(running)


def _request(**kwargs) -> pb.GenerateRequest:
    params = pb.SamplingParams(max_tokens=MAX_TOKENS)
    return pb.GenerateRequest(messages=chat_messages(MESSAGES), params=params, **kwargs)


def _valid(name: str, arguments: str | dict) -> None:
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments) if isinstance(arguments, str) else arguments, WEATHER)


def test_an_auto_call_is_held_to_the_grammar(auto_scripted):
    script = auto_scripted.chat_ids
    free = len(encode_text(load_tokenizer(auto_scripted.path), "OK")) + 1  # "OK" and <tool_call>
    response = auto_scripted.running.client.generate(_request(tools_json=json.dumps(TOOLS)))
    assert list(response.token_ids[:free]) == script[:free]  # mlx-lm's, untouched
    assert list(response.token_ids) != script  # the grammar stepped in after
    assert response.finish_reason == "tool_calls", response
    assert response.text == "OK" and not response.malformed_tool_call
    assert not response.unknown_tools
    [call] = response.tool_calls
    _valid(call.function.name, call.function.arguments)


def test_without_tools_or_with_tool_choice_none_nothing_is_constrained(auto_scripted):
    """Where no call is parsed the grammar never applies: mlx-lm's tokens exactly."""
    script = auto_scripted.chat_ids
    for kwargs in ({}, {"tools_json": json.dumps(TOOLS), "tool_choice": "none"}):
        response = auto_scripted.running.client.generate(_request(**kwargs))
        assert list(response.token_ids) == script


def test_every_door_holds_an_auto_call(auto_scripted):
    reply = auto_scripted.openai.chat.completions.create(
        model=auto_scripted.model, messages=MESSAGES, tools=TOOLS, max_tokens=MAX_TOKENS
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    _valid(call.function.name, call.function.arguments)

    message = auto_scripted.anthropic.messages.create(
        model=auto_scripted.model,
        max_tokens=MAX_TOKENS,
        messages=MESSAGES,
        tools=[{"name": "get_weather", "input_schema": WEATHER, "strict": True}],
        tool_choice={"type": "auto"},
    )
    assert message.stop_reason == "tool_use"
    [use] = [b for b in message.content if b.type == "tool_use"]
    _valid(use.name, use.input)

    reply = auto_scripted.http.post(
        "/api/chat",
        json={
            "model": auto_scripted.model,
            "messages": MESSAGES,
            "tools": TOOLS,
            "stream": False,
            "options": {"num_predict": MAX_TOKENS},
        },
    )
    assert reply.status_code == 200, reply.text
    [call] = reply.json()["message"]["tool_calls"]
    _valid(call["function"]["name"], call["function"]["arguments"])
