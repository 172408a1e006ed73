"""The typed request: every door's adapter builds the same `GenerationRequest` for the
same ask, and the one validator refuses bad input with `InvalidRequest` per field."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from mlx_relay.api import grpc_adapter
from mlx_relay.api.http import anthropic, ollama, openai, responses
from mlx_relay.api.http.common import HttpError
from mlx_relay.api.localai import generate_request as localai_request
from mlx_relay.coordinator.generation import (
    GenerationRequest,
    InvalidRequest,
    Message,
    Tool,
    ToolCall,
    check_sampling,
    sampling,
    tools,
)
from mlx_relay.coordinator.sampling import RANGES, SamplingParams
from mlx_relay.protocol import relay_pb2 as pb
from mlx_relay.protocol.localai import backend_pb2 as lpb

VOCAB = 100
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {}}}


def _check(max_tokens: int | None = None, **options) -> SamplingParams:
    request = GenerationRequest(prompt="hi", max_tokens=max_tokens, sampling=sampling(**options))
    return check_sampling(request, vocab_size=VOCAB, default_max_tokens=7)


# --- the validator ----------------------------------------------------------------------


def test_defaults_are_the_engines_and_max_tokens_the_servers():
    params = _check()
    assert params == SamplingParams(max_tokens=7)
    assert _check(3, top_logprobs=2).max_tokens == 3
    assert _check(top_logprobs=2).logprobs  # top_logprobs implies logprobs, on every door


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"top_k": VOCAB}, "top_k"),
        ({"top_k": -1}, "top_k"),
        ({"xtc_probability": 2.0}, "xtc_probability"),
        ({"xtc_threshold": 0.6}, "xtc_threshold"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"frequency_penalty": math.inf}, "frequency_penalty"),
        ({"repetition_context_size": -1}, "repetition_context_size"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"logit_bias": {VOCAB: 1.0}}, "logit_bias"),
        ({"logit_bias": {1: math.nan}}, "logit_bias"),
        ({"num_draft_tokens": -1}, "num_draft_tokens"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"top_k": 2**40}, "top_k"),
    ],
)
def test_each_bad_option_is_one_invalid_request_naming_it(options, field):
    max_tokens = options.pop("max_tokens", None)
    with pytest.raises(InvalidRequest, match=rf"^{field}"):
        _check(max_tokens, **options)


def test_every_ranged_option_is_an_engine_option():
    assert set(RANGES) <= set(SamplingParams.__dataclass_fields__)


def test_tools_are_typed_and_a_nameless_one_is_refused():
    (tool,) = tools([WEATHER])
    assert tool.name == "weather" and tool.function["parameters"] == {}
    assert Tool({"name": "bare"}).name == "bare"  # the bare function shape
    with pytest.raises(InvalidRequest, match=r"tools\[0\] has no function name"):
        tools(["weather"])


# --- the adapters: the same ask through each door is the same request --------------------

ASK = GenerationRequest(
    messages=(Message("user", "Weather in Paris?"),),
    max_tokens=5,
    sampling=sampling(temperature=0.5, top_p=0.9, stop=["\n"]),
)


def test_grpc_adapter():
    wire = pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content="Weather in Paris?")],
        params=pb.SamplingParams(max_tokens=5, temperature=0.5, top_p=0.9, stop=["\n"]),
    )
    got = grpc_adapter.generate_request(wire)
    # (the wire's floats are 32-bit)
    assert got.sampling.temperature == 0.5 and math.isclose(got.sampling.top_p, 0.9, rel_tol=1e-6)
    assert got.messages == ASK.messages and got.max_tokens == 5 and got.sampling.stop == ["\n"]
    assert got.sampling.xtc_threshold == 0.1  # proto3 zero: the engine's default
    assert got.sampling.repetition_context_size == 20


def test_grpc_adapter_parses_the_json_fields():
    wire = pb.GenerateRequest(
        prompt="hi",
        tools_json='[{"type": "function", "function": {"name": "weather"}}]',
        chat_template_kwargs_json='{"enable_thinking": false}',
        response_format_json='{"type": "json_object"}',
        params=pb.SamplingParams(logit_bias={3: -1.0}, seed=4),
        tool_choice="weather",
        messages=[
            pb.ChatMessage(
                role="assistant",
                tool_calls=[pb.ToolCall(id="c1", function=pb.ToolCallFunction(name="w"))],
            )
        ],
    )
    got = grpc_adapter.generate_request(wire)
    assert [t.name for t in got.tools] == ["weather"] and got.tool_choice == "weather"
    assert got.chat_template_kwargs == {"enable_thinking": False}
    assert got.response_format == {"type": "json_object"}
    assert got.sampling.logit_bias == {3: -1.0} and got.sampling.seed == 4
    assert got.messages[0].tool_calls == (ToolCall("w", "", "c1", "function"),)
    for field, bad in (
        ("tools", "["),
        ("chat_template_kwargs", "[]"),
        ("response_format", "[]"),
    ):
        with pytest.raises(InvalidRequest, match=f"^{field}"):
            grpc_adapter.generate_request(pb.GenerateRequest(**{f"{field}_json": bad}))


def test_openai_adapter_matches():
    body = openai.ChatRequest(
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        max_tokens=5,
        temperature=0.5,
        top_p=0.9,
        stop="\n",
    )
    got = GenerationRequest(
        messages=openai.chat_messages(body.messages),
        max_tokens=body.max_tokens,
        sampling=body.params(False, None),
    )
    assert got == ASK


def test_anthropic_adapter_matches():
    body = anthropic.MessagesRequest(
        model="m",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        max_tokens=5,
        temperature=0.5,
        top_p=0.9,
        stop_sequences=["\n"],
    )
    assert body.generate_request() == replace(ASK, tool_choice="auto")  # (Anthropic's default)


def test_ollama_adapter_matches():
    body = ollama.ChatRequest(
        model="m",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        options={"num_predict": 5, "temperature": 0.5, "top_p": 0.9, "stop": "\n"},
    )
    assert body.request(messages=ollama.chat_messages(body.messages)) == ASK


def test_responses_adapter_matches():
    body = responses.ResponsesRequest(
        input="Weather in Paris?", max_output_tokens=5, temperature=0.5, top_p=0.9
    )
    assert body.generate_request() == GenerationRequest(
        messages=ASK.messages, max_tokens=5, sampling=sampling(temperature=0.5, top_p=0.9)
    )


def test_localai_adapter_matches():
    options = lpb.PredictOptions(
        Messages=[lpb.Message(role="user", content="Weather in Paris?")],
        UseTokenizerTemplate=True,
        Tokens=5,
        Temperature=0.5,
        TopP=0.9,
        StopPrompts=["\n"],
    )
    got = localai_request(options, VOCAB)
    assert got.messages == ASK.messages and got.max_tokens == 5 and got.sampling.stop == ["\n"]
    assert got.sampling.temperature == 0.5 and math.isclose(got.sampling.top_p, 0.9, rel_tol=1e-6)
    with pytest.raises(InvalidRequest, match="^LogitBias"):
        localai_request(lpb.PredictOptions(Prompt="hi", LogitBias='{"x": 1}'), VOCAB)


def test_an_http_adapters_own_refusal_names_its_param():
    with pytest.raises(HttpError, match="logit_bias must map token ids") as info:
        openai.ChatRequest(messages=[], logit_bias={"x": 1}).params(False, None)
    assert info.value.param == "logit_bias" and info.value.status == 400


def test_every_door_samples_with_the_wires_32_bit_floats():
    http = sampling(top_p=0.9, repetition_penalty=1.1, logit_bias={5: 0.1})
    wire = grpc_adapter.sampling(
        pb.SamplingParams(top_p=0.9, repetition_penalty=1.1, logit_bias={5: 0.1})
    )
    assert http == wire and http.top_p != 0.9  # (0.9 is not a 32-bit float)
    with pytest.raises(InvalidRequest, match="^temperature must be a finite number"):
        _check(temperature=1e300)
