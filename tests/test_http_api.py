"""The HTTP doors through the real OpenAI and Anthropic SDKs, raw httpx and Ollama's
NDJSON, against one real 2-rank cluster of a scripted tiny llama: greedy decoding after
any chat prompt writes `<think>Weather?</think>OK<tool_call>{"name": "get_weather"}
</tool_call>`, so reasoning, content and tool calls are checked exactly, each door
against the gRPC door's answer to the same request."""

from __future__ import annotations

import json
import time

import anthropic
import grpc
import httpx
import openai
import pytest
from mlx_lm.utils import load_tokenizer
from prometheus_client.parser import text_string_to_metric_families
from scripted import MESSAGES, RAW_PROMPT, RAW_SCRIPT, TOOLS

from mlx_relay.protocol import relay_pb2 as pb

pytestmark = pytest.mark.cluster


def _grpc(scripted_http, **kwargs) -> pb.GenerateResponse:
    messages = [pb.ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES]
    request = pb.GenerateRequest(messages=messages, params=pb.SamplingParams(max_tokens=40))
    for name, value in kwargs.items():
        setattr(request, name, value)
    return scripted_http.running.client.generate(request)


# --- OpenAI -------------------------------------------------------------------------


def test_chat_completion_with_tools_equals_the_grpc_answer(scripted_http):
    reply = scripted_http.openai.chat.completions.create(
        model=scripted_http.model, messages=MESSAGES, tools=TOOLS, max_tokens=40
    )
    grpc_reply = _grpc(scripted_http, tools_json=json.dumps(TOOLS))
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" == grpc_reply.finish_reason
    assert choice.message.content == grpc_reply.text == "OK"
    assert choice.message.reasoning_content == grpc_reply.reasoning == "Weather?"
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {})
    ]
    assert calls[0].id and calls[0].type == "function"
    assert reply.usage.completion_tokens == len(scripted_http.chat_ids)
    assert reply.usage.prompt_tokens == grpc_reply.usage.prompt_tokens
    assert reply.usage.completion_tokens_details.reasoning_tokens == 4
    assert reply.model == scripted_http.model and reply.object == "chat.completion"


def test_chat_stream_is_the_non_streaming_answer_in_pieces(scripted_http):
    stream = scripted_http.openai.chat.completions.create(
        model=scripted_http.model,
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "OK"
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Weather?"
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert [(t.index, t.function.name, t.function.arguments) for t in calls] == [
        (0, "get_weather", "{}")
    ]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "tool_calls" and not any(finishes[:-1])
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == len(
        scripted_http.chat_ids
    )
    assert len({c.id for c in chunks}) == 1


def test_sse_framing_over_raw_http(scripted_http):
    body = {"messages": MESSAGES, "max_tokens": 40, "stream": True}
    with scripted_http.http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") and "\n" not in e for e in events[:-1])
    text = "".join(p["choices"][0]["delta"].get("content") or "" for p in payloads)
    assert text == _grpc(scripted_http).text == "OK"


def test_completions_logprobs_streamed_and_not(scripted_http):
    whole = scripted_http.openai.completions.create(
        model=scripted_http.model, prompt=RAW_PROMPT, max_tokens=40, logprobs=3
    )
    choice = whole.choices[0]
    assert choice.text == RAW_SCRIPT[0] and choice.finish_reason == "stop"
    lp = choice.logprobs
    assert "".join(lp.tokens) == RAW_SCRIPT[0]
    # Token by token: the gRPC door's greedy tokens for the same prompt, each decoded alone.
    expected = scripted_http.running.client.generate(
        pb.GenerateRequest(
            prompt=RAW_PROMPT,
            params=pb.SamplingParams(max_tokens=40, logprobs=True, top_logprobs=3),
        )
    )
    tokenizer = load_tokenizer(scripted_http.path)
    assert lp.tokens == [tokenizer.decode([i]) for i in expected.token_ids]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs])
    assert [sorted(top) for top in lp.top_logprobs] == [
        sorted(t.token for t in e.top_logprobs) for e in expected.logprobs
    ]
    assert len(lp.token_logprobs) == whole.usage.completion_tokens == len(lp.top_logprobs)
    assert all(len(top) == 3 for top in lp.top_logprobs)
    # Greedy: each chosen token is the most likely one.
    assert all(
        v == pytest.approx(max(top.values()))
        for v, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True)
    )
    stream = scripted_http.openai.completions.create(
        model=scripted_http.model, prompt=RAW_PROMPT, max_tokens=40, logprobs=3, stream=True
    )
    pieces = list(stream)
    assert "".join(p.choices[0].text for p in pieces) == choice.text
    assert [t for p in pieces for t in p.choices[0].logprobs.tokens] == lp.tokens


def test_chat_logprobs(scripted_http):
    reply = scripted_http.openai.chat.completions.create(
        model=scripted_http.model, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=2
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 5
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)
    assert all(e.logprob == pytest.approx(e.top_logprobs[0].logprob) for e in content)


def test_sampling_fields_reach_the_engine(scripted_http):
    # stop cuts the script where the gRPC door cuts it; seeded sampling repeats itself.
    reply = scripted_http.openai.chat.completions.create(
        model=scripted_http.model, messages=MESSAGES, max_tokens=40, stop=["OK"]
    )
    assert reply.choices[0].message.content == "" and reply.choices[0].finish_reason == "stop"
    kwargs = dict(
        model=scripted_http.model,
        prompt="Once",
        max_tokens=12,
        temperature=1.0,
        top_p=0.9,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"5": 2.0},
        extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1},
    )
    first = scripted_http.openai.completions.create(**kwargs).choices[0].text
    assert scripted_http.openai.completions.create(**kwargs).choices[0].text == first
    params = pb.SamplingParams(
        max_tokens=12,
        temperature=1.0,
        top_p=0.9,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        top_k=50,
        min_p=0.01,
        repetition_penalty=1.1,
    )
    params.logit_bias[5] = 2.0
    grpc_text = scripted_http.running.client.generate(
        pb.GenerateRequest(prompt="Once", params=params)
    ).text
    assert first == grpc_text


def test_n_choices_are_n_requests(scripted_http):
    chat = scripted_http.openai.chat.completions.create(
        model=scripted_http.model, messages=MESSAGES, tools=TOOLS, max_tokens=40, n=3
    )
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert {(c.message.content, c.finish_reason) for c in chat.choices} == {("OK", "tool_calls")}
    assert chat.usage.completion_tokens == 3 * len(scripted_http.chat_ids)
    # Seeded: choice i is what a single request seeded seed + i gives.
    kwargs = dict(model=scripted_http.model, prompt="Once", max_tokens=10, temperature=1.0)
    several = scripted_http.openai.completions.create(**kwargs, seed=7, n=2)
    singles = [
        scripted_http.openai.completions.create(**kwargs, seed=s).choices[0].text for s in (7, 8)
    ]
    assert [c.text for c in several.choices] == singles and singles[0] != singles[1]
    stream = scripted_http.openai.completions.create(**kwargs, seed=7, n=2, stream=True)
    texts = ["", ""]
    for piece in stream:
        for choice in piece.choices:
            texts[choice.index] += choice.text
    assert texts == singles


def test_models_and_tokenize(scripted_http):
    assert [m.id for m in scripted_http.openai.models.list()] == [scripted_http.model]
    tokens = scripted_http.http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    back = scripted_http.http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert back["prompt"] == "Hello world"
    chat = scripted_http.http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat["count"] == _grpc(scripted_http).usage.prompt_tokens


# --- errors ------------------------------------------------------------------------------


def test_openai_errors_have_the_openai_shape_and_status(scripted_http):
    with pytest.raises(openai.NotFoundError) as e:
        scripted_http.openai.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert "gpt-4o" in e.value.message and e.value.code == "model_not_found"
    image = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            ],
        }
    ]
    with pytest.raises(openai.BadRequestError) as e:
        scripted_http.openai.chat.completions.create(model=scripted_http.model, messages=image)
    assert "image" in e.value.message and "text only" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        scripted_http.openai.chat.completions.create(
            model=scripted_http.model, messages=MESSAGES, n=17
        )
    assert e.value.param == "n"
    with pytest.raises(openai.BadRequestError) as e:
        scripted_http.openai.chat.completions.create(
            model=scripted_http.model, messages=MESSAGES, temperature=-1
        )
    assert "temperature must be >= 0" in e.value.message
    with pytest.raises(openai.BadRequestError, match="logit_bias token id 99999"):
        scripted_http.openai.chat.completions.create(
            model=scripted_http.model, messages=MESSAGES, logit_bias={"99999": 1}
        )


@pytest.mark.parametrize(
    "path, shape",
    [("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic"), ("/api/chat", "ollama")],
)
def test_bad_bodies_get_each_apis_error(scripted_http, path, shape):
    json_header = {"content-type": "application/json"}
    cases = [
        (
            scripted_http.http.post(path, content=b'{"messages": [', headers=json_header),
            400,
            "JSON",
        ),
        (scripted_http.http.post(path, json={"messages": "hi", "model": 3}), 400, "messages"),
        (
            scripted_http.http.post(path, content=b"x" * (10 << 20), headers=json_header),
            413,
            "bytes",
        ),
        # Sent without a length (chunked): cut off at the limit all the same.
        (
            scripted_http.http.post(
                path, content=iter([b"x" * (3 << 20)] * 4), headers=json_header
            ),
            413,
            "bytes",
        ),
    ]
    for r, status, words in cases:
        assert r.status_code == status, r.text
        body = r.json()
        if shape == "openai":
            message = body["error"]["message"]
            assert body["error"]["type"] == "invalid_request_error"
        elif shape == "anthropic":
            assert body["type"] == "error"
            message = body["error"]["message"]
            assert body["error"]["type"] in ("invalid_request_error", "request_too_large")
        else:
            message = body["error"]
        assert words in message, message
    assert scripted_http.http.get("/health").status_code == 200


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_structured_output_through_every_door(scripted_http):
    """The random model forced into a schema at temperature 1 still writes valid JSON."""
    import jsonschema

    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    reply = scripted_http.openai.chat.completions.create(
        model=scripted_http.model,
        messages=MESSAGES,
        response_format=schema_format,
        max_tokens=200,
        temperature=1.0,
        seed=3,
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    stream = scripted_http.openai.chat.completions.create(
        model=scripted_http.model,
        messages=MESSAGES,
        response_format=schema_format,
        max_tokens=200,
        temperature=1.0,
        seed=3,
        stream=True,
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == reply.choices[0].message.content
    completion = scripted_http.openai.completions.create(
        model=scripted_http.model,
        prompt="Once",
        extra_body={"response_format": {"type": "json_object"}},
        max_tokens=200,
        temperature=1.0,
        seed=5,
    )
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(completion.choices[0].text), dict)
    ollama = scripted_http.http.post(
        "/api/chat",
        json={
            "model": scripted_http.model,
            "messages": MESSAGES,
            "format": PERSON,
            "stream": False,
            "options": {"num_predict": 200, "temperature": 1.0, "seed": 3},
        },
    ).json()
    assert ollama["done_reason"] == "stop"
    jsonschema.validate(json.loads(ollama["message"]["content"]), PERSON)
    text_format = {"format": {"type": "json_schema", "name": "person", "schema": PERSON}}
    response = scripted_http.openai.responses.create(
        model=scripted_http.model,
        input="Who?",
        text=text_format,
        max_output_tokens=200,
        temperature=1.0,
        extra_body={"seed": 3},
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), PERSON)
    # Plain text is no constraint at all: the script comes out as ever.
    plain = scripted_http.openai.chat.completions.create(
        model=scripted_http.model,
        messages=MESSAGES,
        response_format={"type": "text"},
        max_tokens=40,
    )
    assert plain.choices[0].message.content == "OK"


def test_a_schema_that_is_not_json_schema_is_refused(scripted_http):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "banana"}}}
    with pytest.raises(openai.BadRequestError) as e:
        scripted_http.openai.chat.completions.create(
            model=scripted_http.model, messages=MESSAGES, response_format=bad
        )
    assert "schema" in e.value.message
    r = scripted_http.http.post(
        "/api/generate", json={"model": scripted_http.model, "prompt": "Hi", "format": "yaml"}
    )
    assert r.status_code == 400 and "format" in r.json()["error"]


# --- Anthropic ------------------------------------------------------------------------


def _blocks(message) -> list[tuple]:
    return [
        (b.type, getattr(b, "text", None), getattr(b, "thinking", None), getattr(b, "input", None))
        for b in message.content
    ]


def test_anthropic_messages_with_tools_thinking_and_stream(scripted_http):
    tools = [
        {
            "name": "get_weather",
            "description": "Current weather",
            "input_schema": TOOLS[0]["function"]["parameters"],
        }
    ]
    kwargs = dict(
        model=scripted_http.model, max_tokens=40, messages=MESSAGES, tools=tools, system="Be brief."
    )
    message = scripted_http.anthropic.messages.create(**kwargs)
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[0].thinking == "Weather?"
    assert message.content[1].text == "OK"
    assert (message.content[2].name, message.content[2].input) == ("get_weather", {})
    assert message.stop_reason == "tool_use"
    assert message.usage.output_tokens == len(scripted_http.chat_ids)

    with scripted_http.anthropic.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert _blocks(final) == _blocks(message) and final.stop_reason == "tool_use"

    # The call answered: tool_use and tool_result blocks go back in.
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Weather?", "signature": ""},
                {
                    "type": "tool_use",
                    "id": message.content[2].id,
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": message.content[2].id,
                    "content": "sunny, 21 C",
                },
            ],
        },
    ]
    count = scripted_http.anthropic.messages.count_tokens(
        model=scripted_http.model, messages=history, tools=tools, system="Be brief."
    )
    again = scripted_http.anthropic.messages.create(**{**kwargs, "messages": history})
    # Anthropic's input_tokens exclude cache reads: the three parts add up to the prompt.
    prompt = again.usage.input_tokens + again.usage.cache_read_input_tokens
    assert prompt == count.input_tokens > message.usage.input_tokens
    assert again.usage.cache_creation_input_tokens == 0


def test_anthropic_stop_sequence_names_the_string_that_ended_it(scripted_http):
    reply = scripted_http.anthropic.messages.create(
        model=scripted_http.model, messages=MESSAGES, max_tokens=40, stop_sequences=["OK"]
    )
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", "OK")
    plain = scripted_http.anthropic.messages.create(
        model=scripted_http.model, messages=MESSAGES, max_tokens=40
    )
    assert plain.stop_sequence is None


def test_anthropic_errors(scripted_http):
    with pytest.raises(anthropic.NotFoundError) as e:
        scripted_http.anthropic.messages.create(model="claude-x", max_tokens=5, messages=MESSAGES)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        scripted_http.anthropic.messages.create(
            model=scripted_http.model, max_tokens=0, messages=MESSAGES
        )
    assert "max_tokens must be at least 1" in e.value.body["error"]["message"]


# --- Responses API and Ollama ---------------------------------------------------------


def test_responses_api_text_and_function_calls(scripted_http):
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "parameters": TOOLS[0]["function"]["parameters"],
        }
    ]
    reply = scripted_http.openai.responses.create(
        model=scripted_http.model, input=MESSAGES[0]["content"], tools=tools, max_output_tokens=40
    )
    assert reply.status == "completed"
    assert [item.type for item in reply.output] == ["reasoning", "message", "function_call"]
    assert reply.output_text == "OK"
    assert reply.output[2].name == "get_weather"
    events = list(
        scripted_http.openai.responses.create(
            model=scripted_http.model,
            input=MESSAGES[0]["content"],
            tools=tools,
            max_output_tokens=40,
            stream=True,
        )
    )
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == "OK"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == "OK"
    # The SDK's own accumulator rebuilds the same response from the events.
    with scripted_http.openai.responses.stream(
        model=scripted_http.model, input=MESSAGES[0]["content"], tools=tools, max_output_tokens=40
    ) as stream:
        final = stream.get_final_response()
    assert final.output_text == "OK" and final.output[2].name == "get_weather"


def test_ollama_chat_generate_and_model_info(scripted_http):
    with scripted_http.http.stream(
        "POST",
        "/api/chat",
        json={"model": scripted_http.model, "messages": MESSAGES, "tools": TOOLS},
    ) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert all(not line["done"] for line in lines[:-1]) and lines[-1]["done"]
    assert "".join(line["message"]["content"] for line in lines) == "OK"
    assert "".join(line["message"].get("thinking", "") for line in lines) == "Weather?"
    calls = [c for line in lines for c in line["message"].get("tool_calls", [])]
    assert calls == [{"function": {"name": "get_weather", "arguments": {}}}]
    assert lines[-1]["eval_count"] == len(scripted_http.chat_ids)
    whole = scripted_http.http.post(
        "/api/generate",
        json={"model": scripted_http.model, "prompt": RAW_PROMPT, "raw": True, "stream": False},
    ).json()
    assert whole["response"] == RAW_SCRIPT[0] and whole["done_reason"] == "stop"
    tags = scripted_http.http.get("/api/tags").json()["models"]
    assert [t["name"] for t in tags] == [scripted_http.model]
    show = scripted_http.http.post("/api/show", json={"model": scripted_http.model}).json()
    assert show["details"]["family"] == "llama" and "tools" in show["capabilities"]
    assert scripted_http.http.get("/api/version").json()["version"]
    load = scripted_http.http.post("/api/generate", json={"model": scripted_http.model}).json()
    assert load["done"] and load["done_reason"] == "load"
    missing = scripted_http.http.post("/api/chat", json={"model": "llama3", "messages": MESSAGES})
    assert missing.status_code == 404 and "llama3" in missing.json()["error"]


# --- operations -------------------------------------------------------------------------


def _metrics(scripted_http) -> dict[tuple[str, tuple], float]:
    text = scripted_http.http.get("/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_move_by_the_right_amounts(scripted_http):
    before = _metrics(scripted_http)
    reply = scripted_http.openai.chat.completions.create(
        model=scripted_http.model, messages=MESSAGES, max_tokens=40
    )
    after = _metrics(scripted_http)

    def moved(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    outcome = reply.choices[0].finish_reason
    assert moved("mlx_relay:requests_total", api="openai", outcome=outcome) == 1
    assert moved("mlx_relay:prompt_tokens_total") == reply.usage.prompt_tokens
    assert moved("mlx_relay:generation_tokens_total") == reply.usage.completion_tokens
    assert moved("mlx_relay:time_to_first_token_seconds_count") == 1
    assert moved("mlx_relay:e2e_request_latency_seconds_count") == 1
    assert moved("mlx_relay:inter_token_latency_seconds_count") == reply.usage.completion_tokens - 1
    assert (
        moved("mlx_relay:prefix_cache_hits_total")
        == reply.usage.prompt_tokens_details.cached_tokens
    )
    assert after[("mlx_relay:num_requests_running", ())] == 0
    assert after[("mlx_relay:engine_serving", ())] == 1
    with pytest.raises(openai.BadRequestError):
        scripted_http.openai.chat.completions.create(
            model=scripted_http.model, messages=MESSAGES, top_p=2
        )
    assert (
        _metrics(scripted_http)[
            ("mlx_relay:requests_total", (("api", "openai"), ("outcome", "invalid")))
        ]
        >= 1
    )


def test_metrics_count_the_grpc_door_too(scripted_http):
    """One registry for every door: a gRPC request shows under api="grpc"."""
    before = _metrics(scripted_http)
    reply = _grpc(scripted_http)
    with pytest.raises(grpc.RpcError):
        _grpc(scripted_http, tool_choice="nonsense")
    after = _metrics(scripted_http)

    def moved(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert moved("mlx_relay:requests_total", api="grpc", outcome=reply.finish_reason) == 1
    assert moved("mlx_relay:requests_total", api="grpc", outcome="invalid") == 1
    assert moved("mlx_relay:generation_tokens_total") == reply.usage.completion_tokens


def test_step_times_per_rank_reach_the_metrics(scripted_http):
    scripted_http.openai.completions.create(model=scripted_http.model, prompt="Hello", max_tokens=8)
    deadline = time.monotonic() + 15  # workers report with their heartbeats
    while True:
        m = _metrics(scripted_http)
        if m.get(("mlx_relay:rank_steps_total", (("rank", "1"),)), 0) > 0 or (
            time.monotonic() > deadline
        ):
            break
        time.sleep(0.5)
    assert m[("mlx_relay:rank_steps_total", (("rank", "1"),))] > 0
    assert m[("mlx_relay:rank_step_seconds_total", (("rank", "1"),))] > 0
    assert m[("mlx_relay:ring_steps_total", (("kind", "decode"),))] > 0
    assert m[("mlx_relay:ring_step_seconds_total", (("kind", "prefill"),))] > 0


def test_status_lists_each_running_request(scripted_http):
    request = pb.GenerateRequest(
        prompt="Hello", params=pb.SamplingParams(max_tokens=400, ignore_eos=True)
    )
    stream = scripted_http.running.client.stream(request)
    generated = 0
    for chunk in stream:
        generated += len(chunk.token_ids)
        if generated >= 3:
            break
    running = scripted_http.http.get("/v1/status").json()["requests"]
    stream.cancel()
    assert len(running) == 1, running
    (status,) = running
    assert status["phase"] == "decode"
    assert status["generated_tokens"] >= 2
    assert status["prefilled_tokens"] == status["prompt_tokens"] > 0
    assert status["time_to_first_token_s"] > 0 and status["decode_tokens_per_s"] > 0
    deadline = time.monotonic() + 30  # the cancel frees the slot at the next step
    while scripted_http.http.get("/v1/status").json()["requests"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert scripted_http.http.get("/v1/status").json()["requests"] == []


def test_health(scripted_http):
    r = scripted_http.http.get("/health")
    assert r.status_code == 200
    assert r.json() == {
        "status": "ok",
        "state": "serving",
        "model": scripted_http.model,
        "ranks": 2,
    }
    status = scripted_http.http.get("/v1/status").json()
    assert status["state"] == "serving" and status["model"] == scripted_http.model
    assert [(r["rank"], r["layer_start"]) for r in status["ranks"]] == [(0, 0), (1, 2)]
    assert status["active_requests"] == 0


def _idle(scripted_http, within: float) -> bool:
    deadline = time.monotonic() + within
    while scripted_http.running.client.status().active_requests and time.monotonic() < deadline:
        time.sleep(0.05)
    return scripted_http.running.client.status().active_requests == 0


def _counted(scripted_http, key, value: float, within: float = 10) -> bool:
    """The counter reaches `value` (the last chunk may reach the door after status says idle)."""
    deadline = time.monotonic() + within
    while _metrics(scripted_http).get(key, 0) < value and time.monotonic() < deadline:
        time.sleep(0.05)
    return _metrics(scripted_http).get(key, 0) == value


def test_disconnect_mid_stream_cancels_and_the_cluster_keeps_serving(scripted_http):
    # ignore_eos: the scripted model would otherwise stop at once; 2000 tokens take a while.
    body = {"prompt": "Once", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    left = ("mlx_relay:requests_total", (("api", "openai"), ("outcome", "disconnected")))
    before = _metrics(scripted_http).get(left, 0)
    for _ in range(3):
        with scripted_http.http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert sum(1 for line, _ in zip(lines, range(6), strict=False) if line) >= 3
        # The response closed after a few events: the request goes at the next step.
        assert _idle(scripted_http, 10)
    assert _counted(scripted_http, left, before + 3)
    reply = scripted_http.openai.chat.completions.create(
        model=scripted_http.model, messages=MESSAGES, max_tokens=40
    )
    expected = _grpc(scripted_http)
    assert reply.choices[0].message.content == expected.text == "OK"
    assert reply.choices[0].finish_reason == expected.finish_reason


def test_disconnect_before_a_whole_answer_cancels_it(scripted_http):
    cancelled = ("mlx_relay:requests_total", (("api", "openai"), ("outcome", "cancelled")))
    before = _metrics(scripted_http).get(cancelled, 0)
    body = {"prompt": "Once", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        scripted_http.http.post("/v1/completions", json=body, timeout=1.0)
    # The engine ended it as cancelled (its finish reason), not at max_tokens.
    assert _idle(scripted_http, 10)
    assert _counted(scripted_http, cancelled, before + 1)


def test_200_concurrent_streams_with_random_disconnects(scripted_http):
    """Every stream ends: answered whole, refused with 429 (queue full), or dropped by its
    client; afterwards nothing runs, nothing waits, and the cluster still answers."""
    import asyncio
    import random

    rng = random.Random(0)
    body = {"prompt": "Once", "max_tokens": 30, "ignore_eos": True, "stream": True}

    async def one(client: httpx.AsyncClient, leave_after: int | None) -> str:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                assert r.status_code == 429, r.text
                assert "server busy" in json.loads(r.text)["error"]["message"]
                return "refused"
            events = 0
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return "done"
                events += bool(line)
                if leave_after is not None and events >= leave_after:
                    return "left"
        return "cut"

    async def all_of_them() -> list[str]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(
            base_url=scripted_http.base, timeout=120, limits=limits
        ) as client:
            plans = [rng.choice([None, 1, 5, 15]) for _ in range(200)]
            return await asyncio.gather(*(one(client, plan) for plan in plans))

    outcomes = asyncio.run(all_of_them())
    assert "cut" not in outcomes
    assert outcomes.count("done") + outcomes.count("left") >= 8
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status = scripted_http.running.client.status()
        if not status.active_requests and not status.queued_requests:
            break
        time.sleep(0.1)
    assert (status.active_requests, status.queued_requests) == (0, 0)
    assert scripted_http.http.get("/health").status_code == 200
    reply = scripted_http.openai.completions.create(
        model=scripted_http.model, prompt=RAW_PROMPT, max_tokens=40
    )
    assert reply.choices[0].text == RAW_SCRIPT[0]
