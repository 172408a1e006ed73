"""Bad and hostile input through gRPC, against one real 2-rank cluster behind TLS and a
bearer token.

Every answer must be a proper status: OK or one that says what the caller did wrong
(never INTERNAL, UNKNOWN or a hang), the cluster must keep serving, and a final greedy
request must still match single-process mlx-lm token for token.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import grpc
import pytest
from conftest import RunningCluster, self_signed_cert, start_cluster, stop_cluster
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from oracle import chat_tokens, mlx_lm_tokens
from tiny_models import make_tiny_model

from mlx_relay.client.client import Client
from mlx_relay.coordinator.requests import ROLES
from mlx_relay.protocol import relay_pb2 as pb

pytestmark = pytest.mark.cluster

MAX_REQUEST_BYTES = 256 * 1024
MAX_TOKENS = 6  # generation in these tests stays short
CALLER_ERRORS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
SETTINGS = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class Secured:
    def __init__(self, model: Path, running: RunningCluster, token: str, cert: Path) -> None:
        self.model = model
        self.running = running
        self.token = token
        self.cert = cert
        self.address = running.address
        self.client = Client(self.address, token=token, tls_ca=str(cert), timeout=60)

    def other(self, token: str) -> Client:
        return Client(self.address, token=token, tls_ca=str(self.cert), timeout=30)

    def raw(self, method: str, stream: bool = False):
        kind = self.client.channel.unary_stream if stream else self.client.channel.unary_unary
        return kind(
            f"/mlx_relay.v1.Relay/{method}",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("llama-fuzz"), "llama", num_layers=4)
    cert, key = self_signed_cert(tmp_path_factory.mktemp("tls"))
    token = secrets.token_urlsafe(24)
    log_dir = tmp_path_factory.mktemp("fuzz-logs")
    serve_args = ["--tls-cert", str(cert), "--tls-key", str(key)]
    serve_args += ["--max-request-bytes", str(MAX_REQUEST_BYTES), "--default-max-tokens", "4"]
    running = start_cluster(
        model, 2, log_dir, *serve_args, timeout=120, auth_token=token, tls_ca=str(cert)
    )
    out = Secured(model, running, token, cert)
    yield out
    out.client.close()
    stop_cluster(running)


def _code(call) -> tuple[grpc.StatusCode, str]:
    try:
        result = call()
        if not isinstance(result, bytes | pb.GenerateResponse | pb.TokenizeResponse):
            list(result)  # a stream: read it to the end
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def _still_serving(secured: Secured) -> None:
    assert secured.client.serving()
    assert all(p.poll() is None for p in secured.running.cluster.procs), secured.running.logs()


# --- who may call ----------------------------------------------------------------------


def test_every_rpc_needs_the_token(secured):
    calls = {
        "Generate": pb.GenerateRequest(prompt="hi", params=pb.SamplingParams(max_tokens=1)),
        "Tokenize": pb.TokenizeRequest(text="hi"),
        "Status": pb.StatusRequest(),
        "LoadModel": pb.LoadModelRequest(model="/nowhere"),
        "Free": pb.FreeRequest(shutdown=True),  # must not stop anything
    }
    for token in ("", "wrong-" + secured.token):
        with secured.other(token) as stranger:
            for name, request in calls.items():
                code, details = _code(lambda n=name, r=request: getattr(stranger.stub, n)(r))
                assert code == grpc.StatusCode.UNAUTHENTICATED, (name, token, details)
                assert "bearer token" in details
            stream = stranger.stub.GenerateStream(calls["Generate"])
            assert _code(lambda s=stream: s)[0] == grpc.StatusCode.UNAUTHENTICATED
            check = health_pb2.HealthCheckRequest(service="")
            code, _ = _code(lambda s=stranger, c=check: s.health.Check(c, timeout=10))
            assert code == grpc.StatusCode.UNAUTHENTICATED
    _still_serving(secured)
    assert secured.client.status().state == "serving"


def test_plaintext_is_refused_by_a_tls_server(secured):
    with Client(secured.address, token=secured.token, timeout=10) as plain:
        code, _ = _code(lambda: plain.status())
    assert code == grpc.StatusCode.UNAVAILABLE
    _still_serving(secured)


# --- size limits ------------------------------------------------------------------------


def test_oversized_requests_are_refused_before_anything_else(secured):
    code, details = _code(
        lambda: secured.client.generate(pb.GenerateRequest(prompt="a" * (MAX_REQUEST_BYTES + 1)))
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    # Just under the limit: a prompt far beyond the context is refused up front.
    near = " ".join(["word"] * ((MAX_REQUEST_BYTES - 1024) // 5))
    code, details = _code(lambda: secured.client.generate(pb.GenerateRequest(prompt=near)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "context" in details, details
    many = [pb.ChatMessage(role="user", content="hi")] * 20_000
    code, details = _code(lambda: secured.client.generate(pb.GenerateRequest(messages=many)))
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), details
    _still_serving(secured)


# --- hypothesis: structured requests ----------------------------------------------------

_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=60)
_big_text = st.one_of(_text, st.text(st.characters(exclude_categories=("Cs",)), max_size=4000))
_f32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
_int32 = st.integers(-(2**31), 2**31 - 1)
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=8,
)
_json_text = st.one_of(_text, _json.map(json.dumps))


def _mostly(valid: st.SearchStrategy, anything: st.SearchStrategy) -> st.SearchStrategy:
    """Valid values most of the time, so that requests get past the first check."""
    return st.one_of(valid, valid, valid, anything)


@st.composite
def _params(draw) -> pb.SamplingParams:
    """Sane values for half the requests (they reach the engine), anything for the rest."""
    chaos = draw(st.booleans())

    def pick(valid: st.SearchStrategy, anything: st.SearchStrategy) -> st.SearchStrategy:
        return _mostly(valid, anything) if chaos else valid

    p = pb.SamplingParams(
        top_p=draw(pick(st.floats(0, 1, width=32), _f32)),
        top_k=draw(pick(st.integers(0, 50), _int32)),
        min_p=draw(pick(st.floats(0, 1, width=32), _f32)),
        ignore_eos=draw(st.booleans()),
        xtc_probability=draw(pick(st.floats(0, 1, width=32), _f32)),
        xtc_threshold=draw(pick(st.floats(0, 0.5, width=32), _f32)),
        repetition_context_size=draw(pick(st.integers(0, 64), st.integers(-(2**31), 4096))),
        logit_bias=draw(st.dictionaries(pick(st.integers(0, 511), _int32), _f32, max_size=4)),
        stop=draw(pick(st.lists(_text, max_size=4), st.lists(_text, max_size=20))),
        logprobs=draw(st.booleans()),
        top_logprobs=draw(pick(st.integers(0, 5), st.integers(-5, 30))),
    )
    max_tokens = draw(pick(st.integers(1, MAX_TOKENS), st.integers(-(2**31), 0) | st.none()))
    if max_tokens is not None:
        p.max_tokens = max_tokens
    for name in ("temperature", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = draw(st.one_of(st.none(), pick(st.floats(0, 2, width=32), _f32)))
        if value is not None:
            setattr(p, name, value)
    seed = draw(st.one_of(st.none(), pick(st.integers(0, 2**63 - 1), st.integers(-(2**63), -1))))
    if seed is not None:
        p.seed = seed
    return p


_tool_call = st.builds(
    pb.ToolCall,
    id=_text,
    type=_text,
    function=st.builds(pb.ToolCallFunction, name=_text, arguments=_json_text),
)
_role = st.sampled_from(ROLES)
_any_role = st.one_of(_role, st.sampled_from(["", "wizard", "USER", "\x00"]))
_message = st.builds(
    pb.ChatMessage,
    role=st.one_of(*[_role] * 8, _any_role),
    content=_big_text,
    tool_calls=st.lists(_tool_call, max_size=2),
    tool_call_id=_text,
    name=_text,
    reasoning=_text,
)


@st.composite
def _generate(draw) -> pb.GenerateRequest:
    """A prompt, messages, raw prompt bytes, or a mix of all (which must be refused)."""
    request = pb.GenerateRequest(params=draw(_params()), request_id=draw(_text))
    shape = draw(st.sampled_from(["prompt", "messages", "messages", "bytes", "mix"]))
    if shape in ("prompt", "mix"):
        request.prompt = draw(_big_text.filter(bool))
    if shape in ("bytes", "mix"):
        request.prompt_bytes = draw(
            _mostly(_big_text.filter(bool).map(str.encode), st.binary(max_size=200))
        )
    if shape in ("messages", "mix"):
        request.messages.extend(draw(st.lists(_message, min_size=1, max_size=4)))
        request.tools_json = draw(st.one_of(st.just(""), _json_text))
        request.tool_choice = draw(
            st.one_of(st.sampled_from(["", "auto", "none", "required"]), _text)
        )
        request.chat_template_kwargs_json = draw(st.one_of(st.just(""), _json_text))
    return request


_tokenize = st.builds(
    pb.TokenizeRequest,
    text=_big_text,
    messages=st.lists(_message, max_size=3),
    tools_json=st.one_of(st.just(""), _json_text),
    chat_template_kwargs_json=st.one_of(st.just(""), _json_text),
    add_generation_prompt=st.booleans(),
)


@SETTINGS
@given(request=_generate(), stream=st.booleans())
def test_hypothesis_generate_requests_get_proper_statuses(secured, request, stream):
    stub = secured.client.stub
    call = stub.GenerateStream if stream else stub.Generate
    code, details = _code(lambda: call(request, timeout=60))
    event(f"{code.name}: {details[:40]}")
    assert code in CALLER_ERRORS, (code, details, request)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert details, "a refusal must say why"


@SETTINGS
@given(request=_tokenize)
def test_hypothesis_tokenize_requests_get_proper_statuses(secured, request):
    code, details = _code(lambda: secured.client.stub.Tokenize(request, timeout=60))
    event(f"{code.name}: {details[:40]}")
    assert code in CALLER_ERRORS, (code, details, request)


# --- hypothesis: raw protobuf bytes with wrong types ------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


@st.composite
def _wire_field(draw) -> bytes:
    """One field with any number and any wire type: strings as varints, messages as
    fixed64, invalid UTF-8 in strings, lengths that lie, groups, wire types 6 and 7."""
    number = draw(st.integers(1, 20))
    wire = draw(st.integers(0, 7))
    key = _varint(number << 3 | wire)
    if wire == 0:
        return key + _varint(draw(st.integers(-(2**63), 2**64 - 1)))
    if wire == 1:
        return key + draw(st.binary(min_size=8, max_size=8))
    if wire == 2:
        body = draw(st.one_of(st.binary(max_size=40), _text.map(str.encode)))
        length = draw(st.one_of(st.just(len(body)), st.integers(0, 2**32)))
        return key + _varint(length) + body
    if wire == 5:
        return key + draw(st.binary(min_size=4, max_size=4))
    return key + draw(st.binary(max_size=8))  # groups and invalid wire types


@st.composite
def _mutated(draw) -> bytes:
    """A valid request's bytes with a few bytes flipped, cut or inserted."""
    data = bytearray(draw(_generate()).SerializeToString())
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.integers(0, len(data)))
        action = draw(st.sampled_from(["flip", "cut", "insert"]))
        if action == "flip" and where < len(data):
            data[where] ^= draw(st.integers(1, 255))
        elif action == "cut":
            del data[where:]
        else:
            data[where:where] = draw(st.binary(min_size=1, max_size=4))
    return bytes(data)


_raw = st.one_of(
    st.binary(max_size=300),
    st.lists(_wire_field(), min_size=1, max_size=6).map(b"".join),
    _mutated(),
)


def _short(data: bytes) -> bytes:
    """Requests that happen to parse: keep their generation short, the bytes otherwise."""
    try:
        request = pb.GenerateRequest.FromString(data)
    except Exception:  # noqa: BLE001 - unparseable is the interesting case: send as is
        return data
    if request.params.HasField("max_tokens") and request.params.max_tokens > MAX_TOKENS:
        request.params.max_tokens = MAX_TOKENS
        return request.SerializeToString()
    return data


@SETTINGS
@given(data=_raw, method=st.sampled_from(["Generate", "GenerateStream", "Tokenize", "Status"]))
def test_hypothesis_raw_bytes_get_proper_statuses(secured, data, method):
    call = secured.raw(method, stream=method == "GenerateStream")
    code, details = _code(lambda: call(_short(data), timeout=60))
    event(f"{method} {code.name}: {details[:30]}")
    assert code in CALLER_ERRORS, (code, details, data)


# --- and after all that ------------------------------------------------------------------


def test_zz_after_the_fuzzing_greedy_still_matches_mlx_lm(secured):
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    expected = mlx_lm_tokens(secured.model, chat_tokens(secured.model, messages), 20)
    response = secured.client.generate(
        pb.GenerateRequest(
            messages=[pb.ChatMessage(role="user", content="Tell me about the sea.")],
            params=pb.SamplingParams(max_tokens=20),
        )
    )
    assert list(response.token_ids) == expected
    _still_serving(secured)
    status = secured.client.status()
    assert status.state == "serving" and status.error == ""
    log = (secured.running.log_dir / "rank0.log").read_text()
    assert "Traceback" not in log, log[-4000:]
