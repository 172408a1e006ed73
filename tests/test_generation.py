"""Rank 0's generation features through real clusters over real gRPC.

Sampling and every logits processor against single-process mlx-lm, logprobs against
mlx-lm's own logits, stop strings split across tokens on the default model, tools in
the chat template, bad input, and the tool-call path end to end on a scripted model
(a tiny model whose weights make greedy decoding spell out a fixed text).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import grpc
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.utils import load_tokenizer
from oracle import chat_tokens, mlx_lm_tokens, tokenizer_for
from scripted import CHAT_SCRIPT, MESSAGES, RAW_PROMPT, RAW_SCRIPT, TOOLS, script_model
from tiny_models import make_tiny_model

from mlx_relay import cli
from mlx_relay.coordinator.requests import encode_text
from mlx_relay.protocol import relay_pb2 as pb

pytestmark = pytest.mark.cluster

MAX_TOKENS = 24


def _messages(messages=MESSAGES) -> list[pb.ChatMessage]:
    return [pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages]


def _chat(params: pb.SamplingParams | None = None, **kwargs) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=_messages(), params=params, **kwargs)


# --- tiny random model, 1 and 3 ranks -----------------------------------------------


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama", 6)


@pytest.fixture(params=[1, 3], ids=lambda n: f"{n}ranks")
def one_or_three_ranks(request, model, cluster_pool):
    return cluster_pool.serving(model, request.param)


@cache
def _oracle(model, seed, sampler, processors) -> list[int]:
    """mlx-lm's tokens; arguments are hashable (sorted item tuples) for the cache."""
    processors = dict(processors)
    if "logit_bias" in processors:
        processors["logit_bias"] = dict(processors["logit_bias"])
    prompt = chat_tokens(model, MESSAGES)
    return mlx_lm_tokens(
        model, prompt, MAX_TOKENS, seed=seed, sampler=dict(sampler), processors=processors
    )


# (sampler for make_sampler, processors for make_logits_processors). A logit_bias of
# None is filled in from the greedy answer: its first token banned, two others raised.
CASES = {
    "temp": ({"temp": 0.8}, {}),
    "top_p": ({"temp": 0.7, "top_p": 0.9}, {}),
    "top_k": ({"temp": 1.0, "top_k": 5}, {}),
    "min_p": ({"temp": 0.9, "min_p": 0.1}, {}),
    "xtc": ({"temp": 0.8, "xtc_probability": 0.5, "xtc_threshold": 0.05}, {}),
    "repetition_penalty": ({}, {"repetition_penalty": 1.3}),
    "repetition_context_size": ({}, {"repetition_penalty": 1.5, "repetition_context_size": 30}),
    "presence_penalty": ({}, {"presence_penalty": 1.0}),
    "frequency_penalty": ({}, {"frequency_penalty": 0.8}),
    "logit_bias": ({}, {"logit_bias": None}),
    "everything": (
        {"temp": 0.7, "top_p": 0.95, "min_p": 0.02, "top_k": 50, "xtc_probability": 0.3},
        {
            "repetition_penalty": 1.2,
            "repetition_context_size": 10,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.3,
            "logit_bias": None,
        },
    ),
}
SEED = 11


def _sampling_params(sampler: dict, processors: dict, seed: int | None) -> pb.SamplingParams:
    params = pb.SamplingParams(max_tokens=MAX_TOKENS)
    for name, value in sampler.items():
        setattr(params, "temperature" if name == "temp" else name, value)
    if seed is not None:
        params.seed = seed
    for name, value in processors.items():
        if name == "logit_bias":
            params.logit_bias.update(value)
        else:
            setattr(params, name, value)
    return params


@pytest.mark.parametrize("case", list(CASES))
def test_sampling_and_logits_processors_equal_mlx_lm(one_or_three_ranks, model, case):
    sampler, processors = CASES[case]
    seed = SEED if sampler.get("temp") else None
    greedy = _oracle(model, None, (), ())
    if processors.get("logit_bias", 0) is None:
        processors = {**processors, "logit_bias": {greedy[0]: -100.0, 100: 3.0, 7: 1.5}}
    key = lambda d: tuple(sorted(d.items()))  # noqa: E731
    frozen = {k: key(v) if isinstance(v, dict) else v for k, v in processors.items()}
    expected = _oracle(model, seed, key(sampler), key(frozen))
    # The setting matters: without it mlx-lm says something else.
    plain = {"temp": sampler["temp"]} if sampler.get("temp") and case != "temp" else {}
    assert expected != _oracle(model, seed if plain else None, key(plain), ())

    response = one_or_three_ranks.client.generate(
        _chat(_sampling_params(sampler, processors, seed))
    )
    assert list(response.token_ids) == expected
    streamed = list(
        one_or_three_ranks.client.stream(_chat(_sampling_params(sampler, processors, seed)))
    )
    assert [t for c in streamed for t in c.token_ids] == expected


def test_logprobs_are_log_softmax_of_mlx_lm_logits(one_or_three_ranks, model):
    top_n = 5
    request = _chat(pb.SamplingParams(max_tokens=12, logprobs=True, top_logprobs=top_n))
    response = one_or_three_ranks.client.generate(request)
    tokens = list(response.token_ids)
    assert tokens and len(response.logprobs) == len(tokens)

    prompt = chat_tokens(model, MESSAGES)
    mlx_model, tokenizer = load(str(model))
    logits = mlx_model(mx.array(prompt + tokens)[None])[0, len(prompt) - 1 : -1]
    reference = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    for i, (token, entry) in enumerate(zip(tokens, response.logprobs, strict=True)):
        row = reference[i]
        assert entry.token_id == token
        assert entry.token == tokenizer.decode([token])
        assert entry.logprob == pytest.approx(row[token], abs=1e-4)
        best = np.argsort(-row)[:top_n]
        assert [t.token_id for t in entry.top_logprobs] == best.tolist(), f"token {i}"
        expected = row[best].tolist()
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(expected, abs=1e-4)
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([t]) for t in best]
        assert entry.top_logprobs[0].token_id == token  # greedy

    # Streamed: each chunk's logprobs are those of its own tokens.
    chunks = list(one_or_three_ranks.client.stream(request))
    assert [lp.token_id for c in chunks for lp in c.logprobs] == tokens
    for c in chunks:
        assert [lp.token_id for lp in c.logprobs] == list(c.token_ids)
    # logprobs alone: no alternatives; neither: no entries at all.
    alone = one_or_three_ranks.client.generate(
        _chat(pb.SamplingParams(max_tokens=3, logprobs=True))
    )
    assert len(alone.logprobs) == 3 and not any(lp.top_logprobs for lp in alone.logprobs)
    assert not one_or_three_ranks.client.generate(_chat(pb.SamplingParams(max_tokens=3))).logprobs


def test_tokenize_shows_tools_in_the_rendered_prompt(one_or_three_ranks, model):
    request = pb.TokenizeRequest(messages=_messages(), tools_json=json.dumps(TOOLS))
    reply = one_or_three_ranks.client.stub.Tokenize(request, timeout=30)
    assert "<tools>" in reply.prompt
    assert '"name": "get_weather"' in reply.prompt
    assert "Current weather in a city" in reply.prompt
    assert list(reply.token_ids) == encode_text(tokenizer_for(model), reply.prompt)
    plain = one_or_three_ranks.client.stub.Tokenize(
        pb.TokenizeRequest(messages=_messages()), timeout=30
    )
    assert "<tools>" not in plain.prompt and "get_weather" not in plain.prompt


def _with(**params) -> pb.GenerateRequest:
    return _chat(pb.SamplingParams(max_tokens=2, **params))


BAD = {
    "tools not JSON": (_chat(tools_json='[{"type": "function"'), "tools is not valid JSON"),
    "tools not a list": (_chat(tools_json='{"name": "f"}'), "tools must be a JSON list"),
    "tool without a name": (_chat(tools_json='[{"type": "function"}]'), "tools[0]"),
    "tools not JSON, raw prompt": (
        pb.GenerateRequest(prompt="Hi", tools_json="[{"),
        "tools is not valid JSON",
    ),
    "top_logprobs 21": (_with(top_logprobs=21), "top_logprobs"),
    "top_logprobs -1": (_with(top_logprobs=-1), "top_logprobs"),
    "unknown tool_choice": (
        _chat(tools_json=json.dumps(TOOLS), tool_choice="launch_rockets"),
        "tool_choice",
    ),
    "tool_choice without tools": (_chat(tool_choice="get_weather"), "tool_choice"),
    "logit_bias id = vocab size": (_with(logit_bias={512: 1.0}), "logit_bias"),
    "logit_bias id < 0": (_with(logit_bias={-1: 1.0}), "logit_bias"),
    "17 stop strings": (_with(stop=[f"s{i}" for i in range(17)]), "stop"),
    "presence_penalty 2.5": (_with(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
    "frequency_penalty -3": (_with(frequency_penalty=-3), "frequency_penalty must be in [-2, 2]"),
    "chat_template_kwargs not an object": (
        _chat(chat_template_kwargs_json="[1]"),
        "chat_template_kwargs",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_names_the_field_and_the_cluster_keeps_serving(one_or_three_ranks, case):
    request, fragment = BAD[case]
    for call in (
        one_or_three_ranks.client.generate,
        lambda r: list(one_or_three_ranks.client.stream(r)),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert fragment in info.value.details()
    assert one_or_three_ranks.client.generate(_with()).finish_reason


def test_final_chunk_of_a_plain_request(one_or_three_ranks):
    chunks = list(one_or_three_ranks.client.stream(_chat(pb.SamplingParams(max_tokens=5))))
    last = chunks[-1]
    assert last.finish_reason == "length"
    assert all(not c.finish_reason for c in chunks[:-1])
    assert last.usage.completion_tokens == 5 and last.usage.reasoning_tokens == 0
    assert last.usage.total_tokens == last.usage.prompt_tokens + 5
    assert not any(c.tool_calls or c.reasoning for c in chunks)
    assert not last.malformed_tool_call and not last.unknown_tools


# --- the default model (SmolLM2), 2 ranks -----------------------------------------------

QUESTION = "What is the capital of France? Answer in one sentence."
ANSWER = "The capital of France is Paris."  # its greedy answer


@pytest.fixture
def smollm(default_cluster):
    """The session's default-model cluster (tests/conftest.py): these tests only ask it."""
    return default_cluster[0]


def _question(**params) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content=QUESTION)],
        params=pb.SamplingParams(**{"max_tokens": 24, **params}),
    )


def _spans_a_token_boundary(tokenizer, token_ids: list[int], stop: str) -> bool:
    ends, text = [], ""
    for t in token_ids:
        text += tokenizer.decode([t])
        ends.append(len(text))
    start = text.index(stop)
    return any(start < end < start + len(stop) for end in ends)


# Prefill runs at ~10 tokens/s here, so each request costs seconds: the non-streaming
# path (the aggregate of the same stream) is checked for the first case only.
STOP_CASES = [
    (["ce is P"], "The capital of Fran", True),  # held back over three tokens
    (["never", "of France i"], "The capital ", False),  # the first one to complete wins
    (["ce was", "Paris!"], ANSWER, False),  # held back, then released; ends at EOS
]
STOP_IDS = ["held-over-three-tokens", "first-to-complete", "held-then-released"]


def completed_stop(stops: list[str], text: str) -> str:
    """The stop string ANSWER reaches first after `text`."""
    return next(stop for stop in stops if ANSWER[len(text) :].startswith(stop))


@pytest.mark.default_model
@pytest.mark.parametrize("stops, text, also_unary", STOP_CASES, ids=STOP_IDS)
def test_stop_strings_across_token_boundaries(smollm, stops, text, also_unary):
    chunks = list(smollm.client.stream(_question(stop=stops)))
    streamed = "".join(c.text for c in chunks)
    assert streamed == text
    assert chunks[-1].finish_reason == "stop"
    # Which stop string ended it (Anthropic's stop_sequence); none when EOS did.
    assert chunks[-1].stop_sequence == ("" if text == ANSWER else completed_stop(stops, text))
    assert not any(stop in c.text for c in chunks for stop in stops)
    tokens = [t for c in chunks for t in c.token_ids]
    tokenizer = load_tokenizer(Path(smollm.client.status().model_path))
    generated = tokenizer.decode(tokens)  # up to the token that completed the stop string
    assert ANSWER.startswith(generated)
    completed = [stop for stop in stops if stop in generated]
    if text != ANSWER:
        assert len(completed) == 1 and generated.startswith(text + completed[0])
    for stop in stops:
        if stop in ANSWER:
            assert _spans_a_token_boundary(tokenizer, tokens, stop)
    if also_unary:
        whole = smollm.client.generate(_question(stop=stops))
        assert (whole.text, whole.finish_reason) == (text, "stop")
        assert whole.stop_sequence == chunks[-1].stop_sequence
        assert list(whole.token_ids) == tokens


@pytest.mark.default_model
def test_tools_go_into_the_system_prompt_when_the_template_ignores_them(smollm):
    """Issue 38: SmolLM2's template ignores tools; the fallback (tool_prompt) shows them
    in the system prompt instead of refusing the request. (Its prompt is some 250
    tokens, a minute of the default model's prefill on 2 busy cores: test_client_compat
    generates from such prompts through the doors, so this checks the rendering only.)"""
    request = _question()
    request.tools_json = json.dumps(TOOLS)
    tokenize = pb.TokenizeRequest(messages=request.messages, tools_json=request.tools_json)
    shown = smollm.client.stub.Tokenize(tokenize, timeout=30)
    assert "<tools>" in shown.prompt and '"name": "get_weather"' in shown.prompt


# --- a scripted model: tool calls end to end ----------------------------------------------


@pytest.fixture(scope="module")
def scripted_model(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("scripted"), "llama", num_layers=4)
    tokenizer = load_tokenizer(path)  # not oracle's: that caches the weights too
    chat = tokenizer.apply_chat_template(
        MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    chat_end = encode_text(tokenizer, chat)[-1]
    raw_end = encode_text(tokenizer, RAW_PROMPT)[-1]
    assert chat_end != raw_end
    chains = script_model(path, {chat_end: CHAT_SCRIPT, raw_end: RAW_SCRIPT})
    # Single-process mlx-lm generates the script too, with or without tools.
    for prompt in (chat_tokens(path, MESSAGES, tools=TOOLS), chat_tokens(path, MESSAGES)):
        assert mlx_lm_tokens(path, prompt, 40) == chains[chat_end]
    return path, chains[chat_end], chains[raw_end]


@pytest.fixture
def scripted(scripted_model, cluster_pool):
    path, chat_chain, raw_chain = scripted_model
    return cluster_pool.serving(path, 2), chat_chain, raw_chain


def _tool_request(tools=TOOLS, **kwargs) -> pb.GenerateRequest:
    return _chat(pb.SamplingParams(max_tokens=40), tools_json=json.dumps(tools), **kwargs)


def test_tool_call_streamed_end_to_end(scripted):
    running, chat_ids, _ = scripted
    chunks = list(running.client.stream(_tool_request()))
    last = chunks[-1]
    assert last.finish_reason == "tool_calls"
    assert [t for c in chunks for t in c.token_ids] == chat_ids
    assert "".join(c.reasoning for c in chunks) == "Weather?"
    assert "".join(c.text for c in chunks) == "OK"
    assert not any("<" in c.text or "{" in c.text for c in chunks)
    calls = [call for c in chunks for call in c.tool_calls]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {})
    ]
    assert calls[0].type == "function" and calls[0].id and calls[0].index == 0
    # <think>, "Weather", "?", </think>: the markers are reasoning tokens too.
    assert last.usage.reasoning_tokens == 4
    assert last.usage.completion_tokens == len(chat_ids)
    assert not last.malformed_tool_call and not last.unknown_tools

    whole = running.client.generate(_tool_request())
    assert whole.finish_reason == "tool_calls"
    assert (whole.text, whole.reasoning) == ("OK", "Weather?")
    assert [c.function.name for c in whole.tool_calls] == ["get_weather"]
    assert whole.usage.reasoning_tokens == 4


def test_tool_call_to_a_tool_not_offered(scripted):
    """The script calls get_weather; offered only get_time, the call is held to it from
    its `<tool_call>` on (issue 38: auto calls follow the call grammar)."""
    running, _, _ = scripted
    # Bounded, so that the call also ends where the grammar leaves the script.
    zone = {
        "type": "object",
        "properties": {"zone": {"type": "string", "maxLength": 3}},
        "required": ["zone"],
        "additionalProperties": False,
    }
    other = [{"type": "function", "function": {"name": "get_time", "parameters": zone}}]
    response = running.client.generate(_tool_request(tools=other))
    assert not response.unknown_tools and not response.malformed_tool_call
    assert [c.function.name for c in response.tool_calls] == ["get_time"]
    assert len(json.loads(response.tool_calls[0].function.arguments)["zone"]) <= 3
    assert response.finish_reason == "tool_calls"
    assert response.text == "OK"


def test_tool_choice_none_leaves_the_markup_as_text(scripted):
    running, _, _ = scripted
    response = running.client.generate(_tool_request(tool_choice="none"))
    assert response.text == 'OK<tool_call>{"name": "get_weather"}</tool_call>'
    assert response.reasoning == "Weather?"
    assert not response.tool_calls and response.finish_reason == "stop"


def test_malformed_tool_call_is_content_and_flagged(scripted):
    running, _, raw_ids = scripted
    # Without tools nothing holds a call to a grammar (with them, issue 38's auto calls
    # would be: tests/test_tool_auto.py), so the model's broken markup comes back.
    request = pb.GenerateRequest(prompt=RAW_PROMPT, params=pb.SamplingParams(max_tokens=40))
    chunks = list(running.client.stream(request))
    assert [t for c in chunks for t in c.token_ids] == raw_ids
    assert "".join(c.text for c in chunks) == RAW_SCRIPT[0]
    assert chunks[-1].malformed_tool_call and chunks[-1].finish_reason == "stop"
    assert not any(c.tool_calls for c in chunks)


TWO_TOOLS = [
    *TOOLS,
    {"type": "function", "function": {"name": "get_time", "description": "Current time"}},
]
FORCED_SCRIPT = ['{"name": "get_weather"}', "</tool_call>"]


@pytest.fixture(scope="module")
def forced_model(tmp_path_factory):
    """A scripted model that writes a call once the prompt has opened one."""
    path = make_tiny_model(tmp_path_factory.mktemp("forced"), "llama", num_layers=3)
    tokenizer = load_tokenizer(path)
    chat = tokenizer.apply_chat_template(
        MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    end = encode_text(tokenizer, chat + "<tool_call>\n")[-1]
    chains = script_model(path, {end: FORCED_SCRIPT})
    return path, chains[end]


@pytest.fixture
def forced(forced_model, cluster_pool):
    path, script_ids = forced_model
    return cluster_pool.serving(path, 2), path, script_ids


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_tool_choice_forces_a_call_in_the_models_own_markup(forced, choice):
    running, path, script_ids = forced
    # Bounded arguments, so that a random model's call also ends within max_tokens.
    bounded = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 6}},
        "required": ["city"],
        "additionalProperties": False,
    }
    weather = {**TOOLS[0], "function": {**TOOLS[0]["function"], "parameters": bounded}}
    tools = json.dumps([weather, TWO_TOOLS[1]])
    shown = running.client.stub.Tokenize(
        pb.TokenizeRequest(messages=_messages(), tools_json=tools, tool_choice=choice), timeout=30
    )
    assert shown.prompt.endswith("<|im_start|>assistant\n<tool_call>\n")
    assert "get_weather" in shown.prompt
    assert ("get_time" in shown.prompt) == (choice == "required")  # a named tool is shown alone
    # The call is held to a grammar (issue 38): the scripted model's own first tokens
    # (`{"name": "get_weather"`) are allowed, its `}` without arguments is not.
    assert script_ids == mlx_lm_tokens(path, list(shown.token_ids), 20)
    request = _chat(pb.SamplingParams(max_tokens=60), tools_json=tools, tool_choice=choice)
    response = running.client.generate(request)
    assert response.finish_reason == "tool_calls", response
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in response.tool_calls]
    assert [name for name, _ in calls] == ["get_weather"]
    assert list(calls[0][1]) == ["city"] and len(calls[0][1]["city"]) <= 6
    assert response.text == "" and not response.malformed_tool_call
    streamed = list(running.client.stream(request))
    assert [c.function.name for s in streamed for c in s.tool_calls] == ["get_weather"]
    assert "".join(s.text for s in streamed) == ""


def test_tool_choice_that_cannot_be_forced_is_refused(forced):
    running, _, _ = forced
    for request, field in [
        (_chat(tool_choice="required"), "needs tools"),
        (pb.GenerateRequest(prompt="Q", tools_json=json.dumps(TOOLS), tool_choice="required"),
         "raw prompt"),
    ]:  # fmt: skip
        with pytest.raises(grpc.RpcError) as info:
            running.client.generate(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in info.value.details()


# --- the client CLI -----------------------------------------------------------------------


def _cli_json(capsys, *argv: str) -> dict:
    assert cli.main(list(argv)) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_cli_tool_flags_and_json(scripted, tmp_path, capsys):
    running, chat_ids, _ = scripted
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    out = _cli_json(
        capsys, "chat", MESSAGES[0]["content"], "--address", running.address, "--json",
        "--tools", str(tools), "--tool-choice", "auto", "--logprobs", "--top-logprobs", "2",
        "--chat-template-kwargs", '{"enable_thinking": true}', "--max-tokens", "40",
    )  # fmt: skip
    assert out["finish_reason"] == "tool_calls"
    assert out["reasoning"] == "Weather?" and out["text"] == "OK"
    assert out["usage"]["reasoning_tokens"] == 4
    assert [c["function"]["name"] for c in out["tool_calls"]] == ["get_weather"]
    assert out["tool_calls"][0]["type"] == "function"
    assert len(out["logprobs"]) == len(chat_ids)
    entry = out["logprobs"][0]
    assert set(entry) == {"token", "logprob", "top_logprobs"}
    assert entry["token"] == "<think>" and len(entry["top_logprobs"]) == 2
    assert set(entry["top_logprobs"][0]) == {"token", "logprob"}
    assert "unknown_tools" not in out and "malformed_tool_call" not in out
    # Without --json the calls are printed after the text.
    argv = ["chat", MESSAGES[0]["content"], "--address", running.address, "--tools", str(tools)]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.splitlines() == ["OK", "[tool call] get_weather {}"]

    # Offered another tool, the scripted call to get_weather is held to it (issue 38);
    # arguments that can only be {}, so that it ends where the script is left.
    empty = {"type": "object", "properties": {}, "additionalProperties": False}
    other = tmp_path / "other.json"
    other.write_text(
        json.dumps([{"type": "function", "function": {"name": "get_time", "parameters": empty}}])
    )
    out = _cli_json(
        capsys, "chat", MESSAGES[0]["content"], "--address", running.address, "--json",
        "--tools", str(other), "--stream",
    )  # fmt: skip
    assert [c["function"]["name"] for c in out["tool_calls"]] == ["get_time"]
    assert "unknown_tools" not in out and "malformed_tool_call" not in out
    out = _cli_json(capsys, "generate", RAW_PROMPT, "--address", running.address, "--json")
    assert out["malformed_tool_call"] is True


def test_cli_sampling_flags(one_or_three_ranks, model, capsys):
    """Every sampling flag reaches the server: the same tokens as mlx-lm with them."""
    sampler = {"temp": 0.9, "top_p": 0.95, "top_k": 40, "min_p": 0.02}
    sampler |= {"xtc_probability": 0.4, "xtc_threshold": 0.1}
    processors = {"repetition_penalty": 1.2, "repetition_context_size": 12}
    processors |= {"presence_penalty": 0.4, "frequency_penalty": 0.2}
    processors |= {"logit_bias": {7: 2.0, 100: -1.5}}
    expected = mlx_lm_tokens(
        model, chat_tokens(model, MESSAGES), 16, seed=5, sampler=sampler, processors=processors
    )
    out = _cli_json(
        capsys, "chat", MESSAGES[0]["content"], "--address", one_or_three_ranks.address, "--json",
        "--max-tokens", "16", "--seed", "5", "--temperature", "0.9", "--top-p", "0.95",
        "--top-k", "40", "--min-p", "0.02", "--xtc-probability", "0.4",
        "--xtc-threshold", "0.1", "--repetition-penalty", "1.2",
        "--repetition-context-size", "12", "--presence-penalty", "0.4",
        "--frequency-penalty", "0.2", "--logit-bias", "7=2.0", "--logit-bias", "100=-1.5",
    )  # fmt: skip
    assert out["token_ids"] == expected
    assert "logprobs" not in out and "tool_calls" not in out and "reasoning" not in out
    assert out["usage"]["reasoning_tokens"] == 0

    with pytest.raises(SystemExit):
        cli.main(["chat", "hi", "--logit-bias", "seven=2"])
    assert "expected ID=BIAS" in capsys.readouterr().err
