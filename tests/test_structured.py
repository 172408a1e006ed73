"""Structured output: JSON schemas, json_object and GBNF grammars enforced while sampling.

A random-weight model has no idea what JSON is, so whatever it emits under a schema is
the grammar's doing: every output must parse and validate, greedy or at temperature 1.
The schemas bound their strings and arrays (maxLength, maxItems) so that a random model
also finishes within max_tokens; the unbounded json_object mode is tried on the default
model, which writes JSON it means to close.
"""

from __future__ import annotations

import json
import shutil
import threading

import grpc
import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from conftest import start_cluster, stop_cluster
from oracle import chat_tokens, mlx_lm_tokens, tokenizer_for

from mlx_relay import cli
from mlx_relay.coordinator.requests import InvalidRequest
from mlx_relay.protocol import relay_pb2 as pb
from mlx_relay.text import constraints

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "member": {"type": "boolean"},
        },
        "required": ["name", "age", "member"],
        "additionalProperties": False,
    },
    "enum": {"enum": ["red", "green", "blue"]},
    "array": {
        "type": "array",
        "items": {"type": "integer", "minimum": -99, "maximum": 99},
        "minItems": 1,
        "maxItems": 4,
    },
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "tags": {
                "type": "array",
                "items": {"enum": ["a", "b", "c"]},
                "maxItems": 3,
            },
            "owner": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 6},
                    "kind": {"enum": ["user", "bot"]},
                },
                "required": ["name", "kind"],
                "additionalProperties": False,
            },
        },
        "required": ["id", "tags", "owner"],
        "additionalProperties": False,
    },
}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
MAX_TOKENS = 120


def _format(schema: dict) -> str:
    return json.dumps(
        {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}
    )


def _request(params: pb.SamplingParams | None = None, **kwargs) -> pb.GenerateRequest:
    messages = [pb.ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES]
    params = params or pb.SamplingParams()
    if not params.HasField("max_tokens"):
        params.max_tokens = MAX_TOKENS
    return pb.GenerateRequest(messages=messages, params=params, **kwargs)


# --- the mask and the matcher, no cluster ----------------------------------------------


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama", 4)


@pytest.fixture(scope="module")
def compiler(model):
    return constraints.Compiler(tokenizer_for(model))


def test_token_mask_unpacks_llguidance_bits_and_pads_the_vocabulary():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2, size=96).astype(bool)
    packed = np.packbits(bits, bitorder="little").tobytes()
    assert np.array_equal(np.array(constraints.token_mask(packed, 96)), bits)
    assert np.array_equal(np.array(constraints.token_mask(packed, 70)), bits[:70])
    padded = np.array(constraints.token_mask(packed, 100))
    assert np.array_equal(padded[:96], bits) and not padded[96:].any()
    logits = mx.arange(4, dtype=mx.float32)[None]
    masked = constraints.apply_mask(logits, mx.array([True, False, True, False]))
    assert masked.tolist() == [[0.0, -float("inf"), 2.0, -float("inf")]]


def _walk(compiler, grammar: str, pick) -> tuple[str, bool]:
    """Run a constraint to its end, choosing each token with `pick(allowed ids)`."""
    constraint = compiler.constraint(grammar, "test")
    tokenizer = compiler.tokenizer
    eos = set(tokenizer.eos_token_ids)
    out: list[int] = []
    for _ in range(200):
        allowed = np.flatnonzero(np.array(constraint.mask(len(tokenizer._tokenizer))))
        assert allowed.size, "the grammar allowed nothing"
        token = int(pick(allowed))
        if token in eos:
            return tokenizer.decode(out), False
        out.append(token)
        if constraint.advance(token):
            return tokenizer.decode(out), True
    raise AssertionError(f"no end after 200 tokens: {tokenizer.decode(out)!r}")


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_walks_through_the_mask_give_valid_json(compiler, name):
    grammar = constraints.response_format_grammar(_format(SCHEMAS[name]))
    rng = np.random.default_rng(1)
    for _ in range(5):
        text, _ = _walk(compiler, grammar, rng.choice)
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_eos_is_allowed_only_where_the_grammar_may_end(compiler):
    # An integer may go on after "7", so the grammar is not complete: EOS must be allowed
    # there, and nowhere before the first digit.
    constraint = compiler.constraint(constraints.gbnf_grammar("root ::= [0-9]+"), "grammar")
    eos = sorted(compiler.tokenizer.eos_token_ids)[0]
    vocab = len(compiler.tokenizer._tokenizer)
    assert not bool(constraint.mask(vocab)[eos])
    seven = compiler.tokenizer.encode("7", add_special_tokens=False)[0]
    assert constraint.advance(seven) is False
    assert bool(constraint.mask(vocab)[eos])
    # A closed alternative ends by itself.
    text, complete = _walk(compiler, constraints.gbnf_grammar('root ::= "yes" | "no"'), max)
    assert complete and text in ("yes", "no")


def test_the_constraint_waits_for_the_think_end_in_a_reasoning_prompt(compiler):
    grammar = constraints.gbnf_grammar('root ::= "yes" | "no"')
    constraint = compiler.constraint(grammar, "grammar", in_reasoning=True)
    assert not constraint.active and constraint.mask(512) is None
    hello = compiler.tokenizer.encode("Hello", add_special_tokens=False)[0]
    assert constraint.advance(hello) is False and not constraint.active  # thinking is free
    assert constraint.advance(compiler.think_end_id) is False
    assert constraint.active and not bool(constraint.mask(512)[hello])


@pytest.mark.parametrize(
    "response_format, grammar, message",
    [
        ("{not json", "", "response_format is not valid JSON"),
        ('{"type": "xml"}', "", "response_format.type 'xml' is not one of"),
        ('{"type": "json_schema"}', "", "response_format.json_schema must be an object"),
        (_format({"type": "strnig"}), "", "is not a valid JSON Schema"),
        (_format({"type": "object", "required": "name"}), "", "at schema/required"),
        ("", 'root = "x"', "grammar does not parse: Expected ::="),
        ("", "root ::= foo", "grammar does not parse: Rule 'foo' not found"),
        (_format({"type": "object"}), 'root ::= "x"', "either grammar or response_format"),
        (_format({"not": {"type": "string"}}), "", "response_format cannot be enforced: Unim"),
        (_format({"$ref": "http://example.com/s.json"}), "", "cannot be enforced: Resource"),
    ],
)
def test_bad_formats_and_grammars_are_refused_naming_the_field(
    compiler, response_format, grammar, message
):
    with pytest.raises(InvalidRequest, match=message):
        wanted = constraints.request_grammar(response_format, grammar)
        assert wanted is not None
        compiler.constraint(*wanted)


def test_compiled_grammars_are_cached_and_each_request_gets_its_own_matcher(compiler):
    grammar = constraints.gbnf_grammar('root ::= "yes" | "no"')
    first = compiler.constraint(grammar, "grammar")
    second = compiler.constraint(grammar, "grammar")
    assert first.matcher is not second.matcher
    assert grammar in compiler._compiled
    yes = compiler.tokenizer.encode("y", add_special_tokens=False)[0]
    first.advance(yes)  # one request's progress is not the other's
    assert bool(second.mask(512)[yes])


# --- real 2-rank clusters ------------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks(model, tmp_path_factory):
    running = start_cluster(model, 2, tmp_path_factory.mktemp("logs"))
    yield running
    stop_cluster(running)


@pytest.mark.cluster
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_a_random_model_forced_into_a_schema_emits_valid_json(two_ranks, name):
    requests = [_request(response_format_json=_format(SCHEMAS[name]))]
    for seed in (1, 2):
        params = pb.SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS)
        requests.append(_request(params, response_format_json=_format(SCHEMAS[name])))
    for request in requests:
        response = two_ranks.client.generate(request)
        assert response.finish_reason == "stop", response.text
        jsonschema.validate(json.loads(response.text), SCHEMAS[name])


@pytest.mark.cluster
def test_a_seeded_constrained_request_repeats_itself(two_ranks):
    params = pb.SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS)
    request = _request(params, response_format_json=_format(SCHEMAS["nested"]))
    first = two_ranks.client.generate(request)
    assert two_ranks.client.generate(request).token_ids == first.token_ids


@pytest.mark.cluster
def test_a_gbnf_grammar_gives_one_of_its_words(two_ranks):
    for seed in range(3):
        params = pb.SamplingParams(temperature=1.0, seed=seed)
        response = two_ranks.client.generate(_request(params, grammar='root ::= "yes" | "no"'))
        assert response.text in ("yes", "no")
        assert response.finish_reason == "stop"


@pytest.mark.cluster
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"response_format_json": _format({"type": "strnig"})}, "not a valid JSON Schema"),
        ({"response_format_json": '{"type": "yaml"}'}, "response_format.type 'yaml'"),
        ({"grammar": "root ::= missing"}, "grammar does not parse"),
    ],
)
def test_invalid_schema_or_grammar_is_invalid_argument(two_ranks, kwargs, message):
    with pytest.raises(grpc.RpcError) as info:
        two_ranks.client.generate(_request(**kwargs))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()
    assert two_ranks.client.generate(_request(pb.SamplingParams(max_tokens=2))).token_ids


@pytest.mark.cluster
def test_plain_text_format_is_unconstrained_and_equals_mlx_lm(two_ranks, model):
    response = two_ranks.client.generate(
        _request(pb.SamplingParams(max_tokens=16), response_format_json='{"type":"text"}')
    )
    assert list(response.token_ids) == mlx_lm_tokens(model, chat_tokens(model, MESSAGES), 16)


@pytest.mark.cluster
def test_constrained_and_unconstrained_streams_share_a_batch(two_ranks, model):
    """Greedy unconstrained streams still give mlx-lm's tokens beside constrained ones."""
    expected = mlx_lm_tokens(model, chat_tokens(model, MESSAGES), 40)
    results: dict[str, object] = {}

    def run(key: str, request: pb.GenerateRequest) -> None:
        try:
            tokens, text = [], []
            for chunk in two_ranks.client.stream(request):
                tokens += chunk.token_ids
                text.append(chunk.text)
            results[key] = (tokens, "".join(text))
        except Exception as e:  # noqa: BLE001 - reported below
            results[key] = e

    jobs = {"plain0": _request(pb.SamplingParams(max_tokens=40))}
    for i, name in enumerate(sorted(SCHEMAS)):
        params = pb.SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS)
        jobs[name] = _request(params, response_format_json=_format(SCHEMAS[name]))
    jobs["plain1"] = _request(pb.SamplingParams(max_tokens=40))
    threads = [threading.Thread(target=run, args=item) for item in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for key in jobs:
        result = results[key]
        assert not isinstance(result, Exception), result
        tokens, text = result
        if key.startswith("plain"):
            assert tokens == expected
        else:
            jsonschema.validate(json.loads(text), SCHEMAS[key])


@pytest.mark.cluster
def test_cli_json_schema_json_object_and_grammar_flags(two_ranks, tmp_path, capsys):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(SCHEMAS["person"]))
    grammar = tmp_path / "yesno.gbnf"
    grammar.write_text('root ::= "yes" | "no"\n')
    base = ["--address", two_ranks.address, "--max-tokens", str(MAX_TOKENS)]
    assert cli.main(["chat", "Who?", *base, "--json-schema", str(schema)]) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), SCHEMAS["person"])
    assert cli.main(["generate", "Answer:", *base, "--grammar", str(grammar)]) == 0
    assert capsys.readouterr().out.strip() in ("yes", "no")
    # json_object on a random model may not close within max_tokens; the flag is only
    # checked to reach the engine, which keeps the output a JSON object's prefix.
    argv = ["chat", "Who?", "--address", two_ranks.address, "--max-tokens", "6", "--json"]
    assert cli.main([*argv, "--json-object"]) == 0
    assert json.loads(capsys.readouterr().out)["text"].startswith("{")
    schema.write_text("{oops")
    assert cli.main(["chat", "Who?", *base, "--json-schema", str(schema)]) != 0
    assert "not valid JSON" in capsys.readouterr().err


@pytest.mark.cluster
@pytest.mark.default_model
def test_the_default_model_answers_in_a_json_object_and_a_schema(default_cluster):
    running, _ = default_cluster
    question = "Give the name and the capital of France as JSON."
    messages = [pb.ChatMessage(role="user", content=question)]
    params = pb.SamplingParams(max_tokens=96)
    response = running.client.generate(
        pb.GenerateRequest(
            messages=messages, params=params, response_format_json='{"type": "json_object"}'
        )
    )
    assert response.finish_reason == "stop", response.text
    assert isinstance(json.loads(response.text), dict)
    schema = {
        "type": "object",
        "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
        "required": ["country", "capital"],
        "additionalProperties": False,
    }
    seeded = pb.SamplingParams(max_tokens=96, temperature=1.0, seed=0)
    response = running.client.generate(
        pb.GenerateRequest(messages=messages, params=seeded, response_format_json=_format(schema))
    )
    assert response.finish_reason == "stop", response.text
    jsonschema.validate(json.loads(response.text), schema)


# llama.cpp's grammars/json.gbnf, the kind of grammar LocalAI sends.
LLAMA_CPP_JSON_GBNF = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
"""


def test_llama_cpp_json_grammar_accepts_json_and_refuses_the_rest(compiler):
    wanted = constraints.request_grammar("", LLAMA_CPP_JSON_GBNF)
    assert wanted is not None
    tokenizer = compiler.tokenizer
    vocab = len(tokenizer._tokenizer)
    constraint = compiler.constraint(*wanted)
    text = '{"city": "Paris", "temp": [23.5, -1e5], "ok": true, "note": "caf\\u00e9"}'
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert bool(constraint.mask(vocab)[token]), tokenizer.decode([token])
        assert constraint.advance(token) is False
    assert bool(constraint.mask(vocab)[sorted(tokenizer.eos_token_ids)[0]])  # may end here
    fresh = compiler.constraint(*wanted)
    assert not bool(fresh.mask(vocab)[tokenizer.encode("[", add_special_tokens=False)[0]])


@pytest.mark.cluster
def test_a_prompt_that_opens_a_think_block_is_constrained_after_the_think_end(
    model, tmp_path, cluster_factory
):
    """A template that opens the think block (as Qwen3-Thinking's does) leaves the thinking
    free: biased to close it at once, the model writes </think>, then the grammar's words."""
    thinking = tmp_path / "thinking"
    shutil.copytree(model, thinking)
    config_path = thinking / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    opened = "{{- '<|im_start|>assistant\\n<think>\\n' }}"
    config["chat_template"] = config["chat_template"].replace(
        "{{- '<|im_start|>assistant\\n' }}", opened
    )
    assert opened in config["chat_template"]
    config_path.write_text(json.dumps(config))
    running = cluster_factory(thinking, 2)
    think_end = tokenizer_for(model).encode("</think>", add_special_tokens=False)
    params = pb.SamplingParams(max_tokens=MAX_TOKENS, logit_bias={think_end[0]: 100.0})
    response = running.client.generate(_request(params, grammar='root ::= "yes" | "no"'))
    assert response.token_ids[0] == think_end[0]
    assert response.text.strip() in ("yes", "no")
    assert response.finish_reason == "stop"
