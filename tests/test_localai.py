"""LocalAI's backend service on rank 0, through a client generated from the project's
LocalAI-compatible proto, against real clusters: the native gRPC API of the same cluster
is the reference (greedy text and token counts equal), tool calls come back as
tool-call deltas, many streams at once all finish, a cancelled stream frees its slot,
Free/LoadModel/Health/Status tell the truth, and bad input gets a clear status. The
start script LocalAI runs (`--addr` appended) is tested as LocalAI uses it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from conftest import assert_gone, start_cluster
from mlx_lm.utils import load_tokenizer
from oracle import PARIS_QUESTION, PARIS_TOKENS, chat_tokens, mlx_lm_tokens
from scripted import CHAT_SCRIPT, MESSAGES, TOOLS, script_model
from tiny_models import make_tiny_model

from mlx_relay.coordinator.requests import encode_text
from mlx_relay.launch.local import free_ports
from mlx_relay.model.default_model import resolve_model
from mlx_relay.protocol import relay_pb2 as pb
from mlx_relay.protocol.localai import backend_pb2 as lpb
from mlx_relay.protocol.localai import backend_pb2_grpc as lpb_grpc

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "localai-backend.sh"
QUESTION = "Tell me a short story about a cat."
TIMEOUT = 120


class Door:
    """A cluster with its LocalAI door: `.stub` (LocalAI's client) and `.running` (native)."""

    def __init__(self, running, address: str) -> None:
        self.running = running
        self.address = address
        self.channel = grpc.insecure_channel(address)
        self.stub = lpb_grpc.BackendStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        self.running.stop()
        assert_gone(self.running.pids)


def _door(model, n: int, log_dir: Path, env: dict | None = None) -> Door:
    """A cluster serving LocalAI's service on a fresh port (a second try if another
    process took the port between choosing it and binding it)."""
    for attempt in range(2):
        address = f"127.0.0.1:{free_ports(1)[0]}"
        try:
            running = start_cluster(
                model, n, log_dir / f"try{attempt}", "--localai-address", address, env=env
            )
        except AssertionError as e:
            if attempt == 0 and "cannot listen" in str(e):
                continue
            raise
        return Door(running, address)
    raise AssertionError("unreachable")


def _chat(**kwargs) -> lpb.PredictOptions:
    return lpb.PredictOptions(
        Messages=[lpb.Message(role="user", content=QUESTION)],
        UseTokenizerTemplate=True,
        **kwargs,
    )


def _native_chat(max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content=QUESTION)],
        params=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


# --- a tiny random llama on 2 ranks ---------------------------------------------------------


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama", 4)


@pytest.fixture(scope="module")
def door(model, tmp_path_factory):
    served = _door(model, 2, tmp_path_factory.mktemp("localai"))
    yield served
    served.close()


def test_health_says_exactly_ok_and_load_model_accepts_the_served_model(door, model):
    assert door.stub.Health(lpb.HealthMessage(), timeout=TIMEOUT).message == b"OK"
    for name in (str(model), str(model) + "/"):
        result = door.stub.LoadModel(lpb.ModelOptions(Model=name), timeout=TIMEOUT)
        assert result.success and str(model) in result.message
    # LocalAI names the model relative to its models directory; ModelFile is the path.
    result = door.stub.LoadModel(
        lpb.ModelOptions(Model="my-model", ModelFile=str(model)), timeout=TIMEOUT
    )
    assert result.success
    door.stub.LoadModel(lpb.ModelOptions(Model=str(model)), timeout=TIMEOUT)


def test_greedy_text_and_counts_equal_the_native_api(door):
    native = door.running.client.generate(_native_chat(12))
    whole = door.stub.Predict(_chat(Tokens=12, Temperature=0.0), timeout=TIMEOUT)
    assert whole.message.decode() == native.text
    assert whole.tokens == native.usage.completion_tokens == len(native.token_ids)
    assert whole.prompt_tokens == native.usage.prompt_tokens
    assert whole.timing_prompt_processing > 0 and whole.timing_token_generation > 0
    assert [d.content for d in whole.chat_deltas] == [native.text]

    replies = list(door.stub.PredictStream(_chat(Tokens=12), timeout=TIMEOUT))
    assert b"".join(r.message for r in replies) == native.text.encode()
    assert "".join(d.content for r in replies for d in r.chat_deltas) == native.text
    assert [r.tokens for r in replies][-1] == whole.tokens
    assert all(r.prompt_tokens == whole.prompt_tokens for r in replies)
    assert replies[-1].timing_prompt_processing > 0

    # A raw prompt (LocalAI's own template rendered it) takes the same path.
    raw = door.running.client.generate(
        pb.GenerateRequest(prompt="Once upon a time", params=pb.SamplingParams(max_tokens=6))
    )
    reply = door.stub.Predict(lpb.PredictOptions(Prompt="Once upon a time", Tokens=6))
    assert (reply.message.decode(), reply.tokens) == (raw.text, raw.usage.completion_tokens)


def test_sampling_fields_map_onto_the_engine(door, model):
    tokenizer = load_tokenizer(model)
    greedy = door.running.client.generate(_native_chat(6))
    banned = greedy.token_ids[0]
    # LogitBias JSON bans the greedy first token; Penalty/Repeat, seeds and stops map too.
    biased = door.stub.Predict(
        _chat(Tokens=6, LogitBias=json.dumps({str(banned): -100}), Logprobs=1, TopLogprobs=2)
    )
    logprobs = json.loads(biased.logprobs)["content"]
    assert len(logprobs) == biased.tokens and logprobs[0]["id"] != banned
    assert len(logprobs[0]["top_logprobs"]) == 2
    native = pb.GenerateRequest()
    native.CopyFrom(_native_chat(6))
    native.params.logit_bias[banned] = -100
    assert biased.message.decode() == door.running.client.generate(native).text

    sampled = dict(Tokens=8, Temperature=0.9, TopP=0.9, TopK=20, MinP=0.05, Seed=7)
    penalties = dict(Penalty=1.3, Repeat=16, FrequencyPenalty=0.5, PresencePenalty=0.4)
    first = door.stub.Predict(_chat(**sampled, **penalties))
    again = door.stub.Predict(_chat(**sampled, **penalties))
    assert first.message == again.message  # a seed makes it repeatable
    native = _native_chat(8)
    params = native.params
    params.temperature, params.top_p, params.top_k, params.min_p, params.seed = (
        0.9,
        0.9,
        20,
        0.05,
        7,
    )
    params.repetition_penalty, params.repetition_context_size = 1.3, 16
    params.frequency_penalty, params.presence_penalty = 0.5, 0.4
    assert first.message.decode() == door.running.client.generate(native).text

    stop = tokenizer.decode(greedy.token_ids[2:4])
    if stop.strip():
        stopped = door.stub.Predict(_chat(Tokens=6, StopPrompts=[stop]))
        assert stop not in stopped.message.decode()
        assert len(stopped.message) < len(greedy.text.encode())


def test_sixteen_concurrent_streams_all_finish(door):
    results: dict[int, list] = {}

    def run(i: int) -> None:
        options = _chat(Tokens=6 + i % 3, IgnoreEOS=True)
        replies = list(door.stub.PredictStream(options, timeout=TIMEOUT))
        results[i] = replies

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert sorted(results) == list(range(16))
    for i, replies in results.items():
        assert replies[-1].tokens == 6 + i % 3
    native = _native_chat(6)
    native.params.ignore_eos = True
    native = door.running.client.generate(native)
    assert b"".join(r.message for r in results[0]) == native.text.encode()


def test_a_cancelled_stream_leaves_the_cluster_serving(door):
    stream = door.stub.PredictStream(_chat(Tokens=4000, IgnoreEOS=True), timeout=TIMEOUT)
    for _ in zip(range(3), stream, strict=False):
        pass
    stream.cancel()
    deadline = time.monotonic() + 30
    while door.running.client.status().active_requests and time.monotonic() < deadline:
        time.sleep(0.1)
    assert door.running.client.status().active_requests == 0
    assert door.stub.Predict(_chat(Tokens=3), timeout=TIMEOUT).tokens == 3


def test_context_size_is_honoured_or_refused(door, model):
    prompt = len(chat_tokens(model, [{"role": "user", "content": QUESTION}]))
    try:
        door.stub.LoadModel(lpb.ModelOptions(Model=str(model), ContextSize=prompt + 3))
        capped = door.stub.Predict(_chat(Tokens=50), timeout=TIMEOUT)
        assert capped.tokens == 3
        with pytest.raises(grpc.RpcError) as info:
            door.stub.Predict(
                lpb.PredictOptions(Prompt="word " * (prompt + 10), Tokens=2), timeout=TIMEOUT
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ContextSize" in info.value.details()
    finally:
        door.stub.LoadModel(lpb.ModelOptions(Model=str(model)))
    with pytest.raises(grpc.RpcError) as info:
        door.stub.LoadModel(lpb.ModelOptions(Model=str(model), ContextSize=10**7))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "context_size" in info.value.details()


BAD = {
    "negative temperature": (_chat(Temperature=-1.0), "INVALID_ARGUMENT", "temperature"),
    "logit bias not JSON": (_chat(LogitBias="{"), "INVALID_ARGUMENT", "LogitBias"),
    "unknown role": (
        lpb.PredictOptions(Messages=[lpb.Message(role="robot", content="hi")]),
        "INVALID_ARGUMENT",
        "role",
    ),
    "tool calls not JSON": (
        lpb.PredictOptions(
            Messages=[lpb.Message(role="assistant", content="", tool_calls="[{")],
            UseTokenizerTemplate=True,
        ),
        "INVALID_ARGUMENT",
        "Messages[0].tool_calls",
    ),
    "tools not JSON": (_chat(Tools="[{"), "INVALID_ARGUMENT", "tools"),
    "an image": (_chat(Images=["aGk="]), "INVALID_ARGUMENT", "reads text only"),
    "grammar that does not parse": (
        _chat(Grammar="root ::= missing"),
        "INVALID_ARGUMENT",
        "grammar",
    ),
    "enable_thinking": (_chat(Metadata={"enable_thinking": "maybe"}), "INVALID_ARGUMENT", "true"),
    "another model": (_chat(ModelIdentity="someone-else"), "NOT_FOUND", "model identity mismatch"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gets_a_clear_status_and_the_cluster_keeps_serving(door, model, case):
    door.stub.LoadModel(lpb.ModelOptions(Model=str(model)))  # the identity to compare with
    request, code, words = BAD[case]
    for call in (door.stub.Predict, lambda r: list(door.stub.PredictStream(r))):
        with pytest.raises(grpc.RpcError) as info:
            call(request)
        assert info.value.code().name == code
        assert words in info.value.details()
    assert door.stub.Predict(_chat(Tokens=2), timeout=TIMEOUT).tokens == 2


def test_a_gbnf_grammar_is_enforced(door, model):
    """LocalAI's Grammar field reaches the engine's grammar-constrained sampling."""
    door.stub.LoadModel(lpb.ModelOptions(Model=str(model)))
    for seed in (1, 2, 3):
        reply = door.stub.Predict(
            _chat(Grammar='root ::= "yes" | "no"', Temperature=1.0, Seed=seed, Tokens=8),
            timeout=TIMEOUT,
        )
        assert reply.message.decode() in ("yes", "no")


def test_load_model_refuses_another_model(door, tmp_path):
    with pytest.raises(grpc.RpcError) as info:
        door.stub.LoadModel(lpb.ModelOptions(Model=str(tmp_path)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "this cluster serves" in info.value.details() and "--model" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        door.stub.LoadModel(lpb.ModelOptions(LoraAdapter="/adapters/x"))
    assert "LoraAdapter" in info.value.details()


def test_other_modalities_are_unimplemented_with_a_message(door):
    with pytest.raises(grpc.RpcError) as info:
        door.channel.unary_unary("/backend.Backend/GenerateImage")(b"", timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "GenerateImage is not implemented" in info.value.details()


def test_messages_tools_and_metadata_render_as_the_native_api_renders_them(door):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather"}}
    call["function"]["arguments"] = '{"city": "Paris"}'
    options = lpb.PredictOptions(
        Messages=[
            lpb.Message(role="system", content="Be brief."),
            lpb.Message(role="user", content="Weather in Paris?", name="ann"),
            lpb.Message(role="assistant", content="", tool_calls=json.dumps([call])),
            lpb.Message(role="tool", content='{"sky": "clear"}', tool_call_id="call_1"),
        ],
        UseTokenizerTemplate=True,
        Tools=json.dumps(TOOLS),
        Metadata={"enable_thinking": "false", "reasoning_effort": "low"},
    )
    native = pb.TokenizeRequest(
        messages=[
            pb.ChatMessage(role="system", content="Be brief."),
            pb.ChatMessage(role="user", content="Weather in Paris?", name="ann"),
            pb.ChatMessage(
                role="assistant",
                tool_calls=[
                    pb.ToolCall(
                        id="call_1",
                        type="function",
                        function=pb.ToolCallFunction(
                            name="get_weather", arguments='{"city": "Paris"}'
                        ),
                    )
                ],
            ),
            pb.ChatMessage(role="tool", content='{"sky": "clear"}', tool_call_id="call_1"),
        ],
        tools_json=json.dumps(TOOLS),
        chat_template_kwargs_json=json.dumps({"enable_thinking": False, "reasoning_effort": "low"}),
    )
    expected = door.running.client.stub.Tokenize(native, timeout=TIMEOUT)
    assert "Paris" in expected.prompt and "get_weather" in expected.prompt
    got = door.stub.TokenizeString(options, timeout=TIMEOUT)
    assert list(got.tokens) == list(expected.token_ids)


def test_tokenize_detokenize_metadata_and_metrics(door, model):
    tokens = door.stub.TokenizeString(lpb.PredictOptions(Prompt="Hello world"))
    tokenizer = load_tokenizer(model)
    assert list(tokens.tokens) == encode_text(tokenizer, "Hello world")
    assert tokens.length == len(tokens.tokens)
    chat = door.stub.TokenizeString(_chat())
    assert list(chat.tokens) == chat_tokens(model, [{"role": "user", "content": QUESTION}])
    text = door.stub.Detokenize(lpb.DetokenizeRequest(tokens=tokens.tokens)).content
    assert text == tokenizer.decode(list(tokens.tokens))
    metadata = door.stub.ModelMetadata(lpb.ModelOptions(Model=str(model)))
    assert "Hello" in metadata.rendered_template
    door.stub.Predict(_chat(Tokens=4))
    metrics = door.stub.GetMetrics(lpb.MetricsRequest())
    assert metrics.tokens_generated >= 4 and metrics.prompt_tokens_processed > 0


def test_free_then_health_and_status_tell_the_truth(door, model):
    status = door.stub.Status(lpb.HealthMessage(), timeout=TIMEOUT)
    assert status.state == lpb.StatusResponse.READY
    assert set(status.memory.breakdown) == {"rank0", "rank1"}
    assert status.memory.total == sum(status.memory.breakdown.values()) > 0

    result = door.stub.Free(lpb.HealthMessage(), timeout=TIMEOUT)
    assert result.success and "freed" in result.message
    assert door.running.client.status().state == "unloaded"
    status = door.stub.Status(lpb.HealthMessage(), timeout=TIMEOUT)
    assert status.state == lpb.StatusResponse.UNINITIALIZED
    # Health is LocalAI's "can I call LoadModel?": yes, and it loads the model again.
    assert door.stub.Health(lpb.HealthMessage()).message == b"OK"
    with pytest.raises(grpc.RpcError) as info:
        door.stub.Predict(_chat(Tokens=2))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no model is loaded" in info.value.details()

    with pytest.raises(grpc.RpcError) as info:  # another model is refused, not loaded
        door.stub.LoadModel(lpb.ModelOptions(Model="/elsewhere/model"), timeout=TIMEOUT)
    assert "this cluster serves" in info.value.details()
    assert door.running.client.status().state == "unloaded"
    assert door.stub.LoadModel(lpb.ModelOptions(Model=str(model)), timeout=TIMEOUT).success
    assert door.stub.Status(lpb.HealthMessage()).state == lpb.StatusResponse.READY
    assert door.stub.Predict(_chat(Tokens=2), timeout=TIMEOUT).tokens == 2


# --- tool calls, through the start script LocalAI runs ----------------------------------------


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """A tiny llama whose greedy answer to MESSAGES (with TOOLS) is CHAT_SCRIPT."""
    path = make_tiny_model(tmp_path_factory.mktemp("scripted"), "llama", num_layers=2)
    tokenizer = load_tokenizer(path)
    chat = tokenizer.apply_chat_template(
        MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    end = encode_text(tokenizer, chat)[-1]
    ids = script_model(path, {end: CHAT_SCRIPT})[end]
    assert mlx_lm_tokens(path, chat_tokens(path, MESSAGES, tools=TOOLS), 40) == ids
    return path, ids


@pytest.fixture(scope="module")
def script_backend(scripted, tmp_path_factory):
    """The start script, run as LocalAI runs it: `--addr` appended, its token in the env."""
    path, ids = scripted
    grpc_port, localai_port = free_ports(2)
    env = {
        **os.environ,
        "MLX_RELAY_MODEL": str(path),
        "MLX_RELAY_RANKS": "2",
        "MLX_RELAY_GRPC_ADDRESS": f"127.0.0.1:{grpc_port}",
        "MLX_RELAY_BIN": str(Path(sys.executable).parent / "mlx-relay"),
        "LOCALAI_GRPC_AUTH_TOKEN": "s3cret",
    }
    log = open(tmp_path_factory.mktemp("script") / "backend.log", "w+")  # noqa: SIM115
    proc = subprocess.Popen(
        [str(SCRIPT), "--addr", f"127.0.0.1:{localai_port}"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{localai_port}")
    stub = lpb_grpc.BackendStub(channel)
    auth = (("authorization", "Bearer s3cret"),)
    try:
        deadline = time.monotonic() + 180
        while True:  # what LocalAI's loader does: Health until "OK"
            try:
                if stub.Health(lpb.HealthMessage(), metadata=auth, timeout=5).message == b"OK":
                    break
            except grpc.RpcError:
                pass
            log.seek(0)
            assert proc.poll() is None, f"the script exited: {log.read()}"
            assert time.monotonic() < deadline, f"no Health OK: {log.read()}"
            time.sleep(0.5)
        yield stub, auth, ids, proc
    finally:
        channel.close()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
        log.seek(0)
        output = log.read()
        log.close()
        assert code == 0, output


def _tool_chat(**kwargs) -> lpb.PredictOptions:
    return lpb.PredictOptions(
        Messages=[lpb.Message(role=m["role"], content=m["content"]) for m in MESSAGES],
        UseTokenizerTemplate=True,
        Tools=json.dumps(TOOLS),
        Tokens=40,
        **kwargs,
    )


def test_script_needs_localai_token(script_backend):
    stub, auth, _, _ = script_backend
    with pytest.raises(grpc.RpcError) as info:
        stub.Health(lpb.HealthMessage(), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:
        stub.Health(lpb.HealthMessage(), metadata=(("authorization", "Bearer no"),))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_tool_calls_come_back_as_tool_call_deltas(script_backend, scripted):
    stub, auth, ids, _ = script_backend
    path, _ = scripted
    loaded = stub.LoadModel(lpb.ModelOptions(Model=str(path)), metadata=auth, timeout=TIMEOUT)
    assert loaded.success
    replies = list(stub.PredictStream(_tool_chat(), metadata=auth, timeout=TIMEOUT))
    deltas = [d for r in replies for d in r.chat_deltas]
    assert "".join(d.reasoning_content for d in deltas) == "Weather?"
    assert "".join(d.content for d in deltas) == "OK"
    assert b"".join(r.message for r in replies) == b"OK"  # no tool-call markup as text
    calls = [c for d in deltas for c in d.tool_calls]
    assert [(c.index, c.name, json.loads(c.arguments)) for c in calls] == [(0, "get_weather", {})]
    assert calls[0].id
    assert replies[-1].tokens == len(ids)

    whole = stub.Predict(
        _tool_chat(ToolChoice='"auto"', ModelIdentity=str(path)), metadata=auth, timeout=TIMEOUT
    )
    assert len(whole.chat_deltas) == 1
    delta = whole.chat_deltas[0]
    assert (delta.content, delta.reasoning_content) == ("OK", "Weather?")
    assert [c.name for c in delta.tool_calls] == ["get_weather"]
    assert whole.tokens == len(ids)

    # tool_choice "none" (as LocalAI sends it, JSON): the markup stays text.
    plain = stub.Predict(_tool_chat(ToolChoice='"none"'), metadata=auth, timeout=TIMEOUT)
    assert plain.message.decode() == 'OK<tool_call>{"name": "get_weather"}</tool_call>'
    assert not plain.chat_deltas[0].tool_calls


# --- the default model ---------------------------------------------------------------------


@pytest.mark.default_model
def test_default_model_greedy_equals_native_and_mlx_lm(default_cluster):
    """The session's default-model cluster, through its LocalAI door and natively."""
    running, _ = default_cluster
    with grpc.insecure_channel(running.localai_address) as channel:
        stub = lpb_grpc.BackendStub(channel)
        question = [{"role": "user", "content": PARIS_QUESTION}]
        options = lpb.PredictOptions(
            Messages=[lpb.Message(**m) for m in question],
            UseTokenizerTemplate=True,
            Tokens=PARIS_TOKENS,
            Temperature=0.0,
        )
        reply = stub.Predict(options, timeout=TIMEOUT)
    native = running.client.generate(
        pb.GenerateRequest(
            messages=[pb.ChatMessage(**m) for m in question],
            params=pb.SamplingParams(max_tokens=PARIS_TOKENS),
        )
    )
    assert reply.message.decode() == native.text and "Paris" in native.text
    assert reply.tokens == native.usage.completion_tokens
    path = resolve_model("default")
    assert list(native.token_ids) == mlx_lm_tokens(path, chat_tokens(path, question), PARIS_TOKENS)
