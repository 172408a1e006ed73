"""Real clusters over real gRPC, checked against single-process mlx-lm token for token."""

from __future__ import annotations

import grpc
import pytest
from oracle import chat_tokens, mlx_lm_tokens

from mlx_relay.protocol import relay_pb2 as pb

pytestmark = pytest.mark.cluster

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me a story about a café in Tokyo 🙂 with 3 cats."},
]

# (ranks, family, layers, uneven explicit split, hop mode, warm-up): layer counts that do
# not divide evenly; on a 2-core machine `auto` gives ready hops, so eager ones are asked
# for, and no warm-up at load (the CPU compiles nothing per shape), so one config asks.
CONFIGS = [
    (1, "llama", 5, None, "auto", "auto"),
    (2, "qwen3", 5, None, "auto", "auto"),
    (3, "gemma3_text", 7, None, "auto", "auto"),
    (3, "llama", 7, "1,4,2", "eager", "on"),
    (2, "qwen2", 5, "4,1", "eager", "auto"),
]


@pytest.fixture(
    params=CONFIGS,
    ids=lambda c: f"{c[0]}ranks-{c[1]}-{c[3] or 'even'}-{c[4]}",
)
def config_cluster(request, tiny_model, cluster_pool):
    """(model, cluster, ranks): one of CONFIGS, from the session's pool (each test asks
    again: a test in between may have loaded another model into the same shape)."""
    n, family, num_layers, layers, hops, warm = request.param
    model = tiny_model(family, num_layers)
    running = cluster_pool.serving(model, n, "--hop-mode", hops, "--warm-up", warm, layers=layers)
    if n > 1 and hops != "auto":  # every rank says which hops it took
        assert running.logs().count(f"{hops} hops") == n, running.logs()
    assert ("warmed up in" in running.logs()) == (warm == "on")
    return model, running, n


def _chat(**params) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES],
        params=pb.SamplingParams(**params),
    )


def test_greedy_equals_mlx_lm(config_cluster):
    model, running, n = config_cluster
    expected = mlx_lm_tokens(model, chat_tokens(model, MESSAGES), 40)
    response = running.client.generate(_chat(max_tokens=40))
    assert list(response.token_ids) == expected
    assert response.finish_reason in ("stop", "length")
    assert response.usage.completion_tokens == len(expected)
    assert response.usage.prompt_tokens == len(chat_tokens(model, MESSAGES))


def test_seeded_sampling_equals_mlx_lm(config_cluster):
    model, running, _ = config_cluster
    prompt = chat_tokens(model, MESSAGES)
    for seed in (0, 7):
        expected = mlx_lm_tokens(
            model, prompt, 30, seed=seed, sampler={"temp": 0.8, "top_p": 0.95, "top_k": 40}
        )
        response = running.client.generate(
            _chat(max_tokens=30, temperature=0.8, top_p=0.95, top_k=40, seed=seed)
        )
        assert list(response.token_ids) == expected, f"seed {seed}"


def test_stream_aggregates_to_the_same_answer(config_cluster):
    model, running, _ = config_cluster
    chunks = list(running.client.stream(_chat(max_tokens=25)))
    whole = running.client.generate(_chat(max_tokens=25))
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.token_ids] == list(whole.token_ids)
    assert chunks[-1].finish_reason == whole.finish_reason
    assert all(not c.finish_reason for c in chunks[:-1])
    # Multi-byte characters are never split across chunks.
    for c in chunks:
        assert "\ufffd" not in c.text or "\ufffd" in whole.text


def test_status_reports_every_rank(config_cluster):
    model, running, n = config_cluster
    status = running.client.status()
    assert status.world_size == n and status.state == "serving"
    assert [r.rank for r in status.ranks] == list(range(n))
    ranges = [(r.layer_start, r.layer_end) for r in status.ranks]
    assert ranges[0][0] == 0 and ranges[-1][1] == status.num_layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    assert all(r.rss_bytes > 0 for r in status.ranks)


BAD_REQUESTS = [
    (pb.GenerateRequest(), "neither a prompt nor messages"),
    (pb.GenerateRequest(messages=[pb.ChatMessage(role="wizard", content="hi")]), "role"),
    (pb.GenerateRequest(prompt="hi", params=pb.SamplingParams(max_tokens=0)), "max_tokens"),
    (pb.GenerateRequest(prompt="hi", params=pb.SamplingParams(temperature=-1)), "temperature"),
    (pb.GenerateRequest(prompt="hi" * 3000), "context"),
    (pb.GenerateRequest(prompt_bytes=b"caf\xc3 \xff"), "UTF-8"),
    (pb.GenerateRequest(prompt="hi", params=pb.SamplingParams(top_logprobs=21)), "top_logprobs"),
    (
        pb.GenerateRequest(prompt="hi", params=pb.SamplingParams(logit_bias={10**6: 1.0})),
        "logit_bias",
    ),
    (pb.GenerateRequest(prompt="hi", params=pb.SamplingParams(stop=["x"] * 17)), "stop"),
]


@pytest.mark.parametrize("request_, fragment", BAD_REQUESTS, ids=lambda x: str(x)[:30])
def test_bad_input_is_refused_clearly_and_the_cluster_keeps_serving(
    config_cluster, request_, fragment
):
    model, running, _ = config_cluster
    with pytest.raises(grpc.RpcError) as info:
        running.client.generate(request_)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        list(running.client.stream(request_))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    good = running.client.generate(_chat(max_tokens=3))
    assert good.usage.completion_tokens >= 1 or good.finish_reason == "stop"


def test_invalid_utf8_in_a_string_field_is_refused(config_cluster):
    """Raw bytes that are not a valid message: INVALID_ARGUMENT, not INTERNAL."""
    _, running, _ = config_cluster
    raw = b"\x0a\x03\xff\xfe\xfd"  # field 1 (prompt), 3 bytes of invalid UTF-8
    call = running.client.channel.unary_unary(
        "/mlx_relay.v1.Relay/Generate",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    with pytest.raises(grpc.RpcError) as info:
        call(raw, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert running.client.generate(_chat(max_tokens=2)).finish_reason
