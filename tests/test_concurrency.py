"""Many requests at once: same tokens as alone, safe cancellation, bounded queue."""

from __future__ import annotations

import itertools
import random
import threading
import time

import grpc
import pytest
from conftest import start_cluster
from grpc_health.v1 import health_pb2
from oracle import chat_tokens, mlx_lm_tokens

from mlx_relay.protocol import relay_pb2 as pb

pytestmark = pytest.mark.cluster


def _request(i: int) -> pb.GenerateRequest:
    """A mix: greedy and seeded, short and long outputs, some with stop strings."""
    params = pb.SamplingParams(max_tokens=8 + (i * 7) % 33)
    if i % 2:
        params.temperature = 0.8
        params.seed = 1000 + i
        params.top_p = 0.95
    if i % 4 == 3:
        params.stop.append("e ")
    text = f"Request {i}: tell me about item {i * 13 % 97} and its history." + " more" * (i % 5)
    return pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=text)], params=params)


def _collect(client, request, cancel_after: int | None, out: dict, key: int) -> None:
    tokens: list[int] = []
    text = []
    finish = None
    call = client.stream(request)
    try:
        for chunk in call:
            tokens.extend(chunk.token_ids)
            text.append(chunk.text)
            if chunk.finish_reason:
                finish = chunk.finish_reason
            if cancel_after is not None and len(tokens) >= cancel_after:
                call.cancel()
                break
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.CANCELLED:
            out[key] = e
            return
    out[key] = (tokens, "".join(text), finish)


@pytest.fixture(
    scope="module",
    params=[
        ("auto", 0),
        pytest.param(("eager", 0), marks=pytest.mark.exhaustive),
        ("eager", 4),
    ],
    ids=lambda p: f"{p[0]}-hops" + (f"-{p[1]}-in-flight" if p[1] else ""),
)
def busy_cluster(tiny_model, tmp_path_factory, request):
    """Three ranks, many groups in flight; eager hops too (auto is ready on 2 cores), and
    one step more in flight than there are ranks (--steps-in-flight 4). Eager hops with
    the default steps in flight are `exhaustive` (make test-all): eager hops spin on 2
    cores (a minute of this module), and the two other clusters cover each setting
    (ready hops at the default, eager hops with one step more in flight; test_cluster
    runs eager hops at the default on 2 and 3 ranks)."""
    model = tiny_model("llama", 7)
    hops, in_flight = request.param
    running = start_cluster(
        model,
        3,
        tmp_path_factory.mktemp("logs"),
        "--hop-mode",
        hops,
        "--steps-in-flight",
        str(in_flight),
        "--max-active",
        "8",
        "--max-queue",
        "16",
        "--prefill-chunk",
        "16",
    )
    yield model, running
    running.stop()


# Each request's answer alone, from the first cluster of the module that asks: hop modes
# and steps in flight never change tokens (test_hops.py), so the later clusters compare
# against the same answers instead of computing them again.
_SOLO: dict[str, dict[int, object]] = {}


def test_sixteen_concurrent_streams_equal_their_solo_results(busy_cluster):
    model, running = busy_cluster
    client = running.client
    n = 16
    solo = _SOLO.setdefault(str(model), {})
    for i in range(n):
        if i not in solo:
            _collect(client, _request(i), None, solo, i)
    rng = random.Random(5)
    cancel = {i: rng.randint(1, 6) for i in rng.sample(range(n), n // 3)}
    together: dict[int, object] = {}
    threads = [
        threading.Thread(target=_collect, args=(client, _request(i), cancel.get(i), together, i))
        for i in range(n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a stream never finished"
    for i in range(n):
        result = together[i]
        assert not isinstance(result, Exception), f"request {i}: {result}"
        tokens, text, finish = result
        if i in cancel:
            assert tokens == solo[i][0][: len(tokens)], f"cancelled request {i} diverged"
        else:
            assert (tokens, text, finish) == solo[i], f"request {i} differs from its solo run"
    # The ring is still in step: a greedy request equals single-process mlx-lm.
    messages = [{"role": "user", "content": "And finally, one more question."}]
    response = client.generate(
        pb.GenerateRequest(
            messages=[pb.ChatMessage(**m) for m in messages],
            params=pb.SamplingParams(max_tokens=20),
        )
    )
    assert list(response.token_ids) == mlx_lm_tokens(model, chat_tokens(model, messages), 20)
    status = client.status()
    assert status.active_requests == 0 and status.queued_requests == 0


def _first_chunk(call) -> None:
    """Start a stream; the test cancels it later, which is the expected end."""
    try:
        next(iter(call), None)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.CANCELLED, e


def test_full_queue_is_refused_and_health_answers_while_busy(tiny_model, cluster_factory):
    running = cluster_factory(
        tiny_model("llama", 7), 2, "--max-active", "1", "--max-queue", "2", "--prefill-chunk", "8"
    )
    client = running.client
    long_prompt = pb.GenerateRequest(
        prompt="word " * 500, params=pb.SamplingParams(max_tokens=1500, ignore_eos=True)
    )
    calls = [client.stream(long_prompt) for _ in range(3)]
    firsts = [threading.Thread(target=_first_chunk, args=(c,)) for c in calls]
    for t in firsts:
        t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status = client.status()
        if (status.active_requests, status.queued_requests) == (1, 2):
            break
        time.sleep(0.05)
    assert (status.active_requests, status.queued_requests) == (1, 2)
    # The first request has 1500 tokens to generate after its prompt: health answers while
    # it runs (a health check starved of a server thread would wait for a stream to end;
    # the deadline is only a bound against a hang), and the queue is still the same after.
    reply = client.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=60)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    status = client.status()
    assert (status.active_requests, status.queued_requests) == (1, 2), "health waited"
    assert not any(c.done() for c in calls), "health answered only after a stream ended"
    with pytest.raises(grpc.RpcError) as info:
        client.generate(long_prompt)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "busy" in info.value.details()
    for c in calls:
        c.cancel()
    for t in firsts:
        t.join(60)
    deadline = time.monotonic() + 30
    while client.status().active_requests and time.monotonic() < deadline:
        time.sleep(0.1)
    short = client.generate(pb.GenerateRequest(prompt="hi", params=pb.SamplingParams(max_tokens=3)))
    assert short.finish_reason == "length"


def test_long_prompt_prefilled_in_pipelined_chunks_equals_mlx_lm(busy_cluster):
    """Chunks of one prompt travel the ring back to back; mlx-lm prefills with the same chunks."""
    model, running = busy_cluster
    messages = [{"role": "user", "content": "Summarise: " + "the quick brown fox jumps. " * 20}]
    prompt = chat_tokens(model, messages)
    assert len(prompt) > 5 * 16
    response = running.client.generate(
        pb.GenerateRequest(
            messages=[pb.ChatMessage(**m) for m in messages],
            params=pb.SamplingParams(max_tokens=16),
        )
    )
    expected = mlx_lm_tokens(model, prompt, 16, prefill_step_size=16)
    assert list(response.token_ids) == expected


def test_a_long_prompt_does_not_stall_running_streams(tiny_model, cluster_factory):
    """While a stream decodes, a long prompt is prefilled in chunks sized by measured time,
    so the stream keeps its pace (one fixed 1024-token chunk here took about 1 s, two
    hundred of its decode steps)."""
    model = tiny_model("llama", 4, hidden_size=256)
    running = cluster_factory(model, 1, "--prefill-chunk", "1024")
    stamps: list[float] = []

    def decode() -> None:
        request = pb.GenerateRequest(
            prompt="hi", params=pb.SamplingParams(max_tokens=1500, ignore_eos=True)
        )
        for chunk in running.client.stream(request):
            stamps.extend([time.perf_counter()] * len(chunk.token_ids))
            if long_done.is_set():
                break

    long_done = threading.Event()
    thread = threading.Thread(target=decode)
    thread.start()
    deadline = time.monotonic() + 60
    while len(stamps) < 50:
        assert time.monotonic() < deadline and thread.is_alive(), f"{len(stamps)} tokens in 60 s"
        time.sleep(0.01)
    started = time.perf_counter()
    long = running.client.generate(
        pb.GenerateRequest(prompt="w " * 1800, params=pb.SamplingParams(max_tokens=1))
    )
    finished = time.perf_counter()
    long_done.set()
    thread.join(60)
    assert long.usage.prompt_tokens > 1500
    gaps = [(b - a, b) for a, b in itertools.pairwise(stamps)]
    before = [gap for gap, at in gaps if at < started]
    during = [gap for gap, at in gaps if started < at <= finished]
    step = sorted(before)[len(before) // 2]
    print(
        f"\ndecode step {step * 1000:.1f} ms; during the long prefill ({finished - started:.2f} s)"
        f" the longest gap was {max(during) * 1000:.1f} ms over {len(during)} tokens"
    )
    assert len(during) > 10  # the stream went on while the prompt was prefilled
    # (measured against this run's own prefill, so a loaded machine slows both: one
    # unpaced 1024-token chunk alone would hold the stream for over half of it)
    assert max(during) < 0.25 * (finished - started)


def test_a_cancelled_long_prompt_stops_prefilling(tiny_model, cluster_factory):
    """Cancelling a request mid-prefill frees the cluster at the next chunk, not after the
    rest of the prompt."""
    model = tiny_model("llama", 4, hidden_size=256)
    running = cluster_factory(model, 2, "--prefill-chunk", "32", "--no-prompt-cache")
    request = pb.GenerateRequest(prompt="w " * 1800, params=pb.SamplingParams(max_tokens=1))
    started = time.perf_counter()
    running.client.generate(request)
    whole = time.perf_counter() - started
    call = running.client.stream(request)
    # Cancelled once a fifth of the prompt went round the ring (as the status says), so
    # that most of it is still to prefill.
    deadline, seen = time.monotonic() + 60, None
    while True:
        (now,) = running.client.status().requests or [None]
        assert now or not seen, f"the request ended before it was cancelled: {seen}"
        seen = now or seen
        if now and now.phase == "prefill" and now.prefilled_tokens >= now.prompt_tokens / 5:
            break
        assert time.monotonic() < deadline, f"no prefill under way after 60 s: {seen}"
        assert not now or now.phase in ("queued", "prefill"), f"the prefill ended: {now}"
        time.sleep(0.01)
    call.cancel()
    cancelled = time.perf_counter()
    while running.client.status().active_requests:
        assert time.monotonic() < deadline + 60, "the cancelled request still runs after 60 s"
        time.sleep(0.01)
    idle_after = time.perf_counter() - cancelled
    print(f"\ncancelled at {seen.prefilled_tokens} of {seen.prompt_tokens} prompt tokens")
    print(f"\nwhole prefill {whole:.2f} s; idle {idle_after * 1000:.0f} ms after the cancel")
    assert idle_after < 0.3 * whole
