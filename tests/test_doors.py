"""Every front door in one process, against one real `Cluster`: a one-rank engine serving
a tiny llama whose context is CONTEXT tokens (no rank processes, nothing mocked).
FastAPI's TestClient speaks to the HTTP doors (OpenAI, Responses, Anthropic, Ollama,
operations); the native gRPC service and LocalAI's run on an in-process gRPC server.

Checked here: the one `max_tokens` policy on every door (a ceiling, cut to the room the
prompt leaves of the model's context, `--max-context` or LocalAI's ContextSize; only a
prompt that leaves none is refused, api/budget.py), what the doors read through the
cluster's facade (health, status, metrics, the model listings), the shared parsing
helpers, and that a non-streaming answer is its stream folded.
"""

from __future__ import annotations

import dataclasses
import json
from concurrent import futures
from pathlib import Path

import grpc
import mlx.core as mx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import make_tiny_model

from mlx_relay.api.budget import Limit, cap
from mlx_relay.api.cluster import Cluster
from mlx_relay.api.http.app import create_app
from mlx_relay.api.localai import LocalAIServicer
from mlx_relay.api.service import RelayServicer, add_to_server
from mlx_relay.coordinator.config import EngineConfig
from mlx_relay.coordinator.engine import Engine
from mlx_relay.coordinator.generation import GenerationRequest
from mlx_relay.coordinator.output import Chunk
from mlx_relay.coordinator.pipeline import Pipeline
from mlx_relay.coordinator.requests import InvalidRequest, json_field, logit_bias
from mlx_relay.model import memory
from mlx_relay.protocol import relay_pb2 as pb
from mlx_relay.protocol import relay_pb2_grpc as pb_grpc
from mlx_relay.protocol.localai import backend_pb2 as lpb
from mlx_relay.protocol.localai import backend_pb2_grpc as lpb_grpc

CONTEXT = 48  # the tiny model's context: small, so that a request can reach it
OVER = 1000  # a max_tokens far beyond it
USER = [{"role": "user", "content": "Hi"}]


class DoorsInProcess:
    """One in-process engine (a tiny llama on rank 0 alone) behind every door: its HTTP
    app, the gRPC door and LocalAI's backend on one channel."""

    def __init__(self, cluster: Cluster, path: Path, http: TestClient, channel) -> None:
        self.cluster = cluster
        self.model = str(path)
        self.http = http
        self.relay = pb_grpc.RelayStub(channel)
        self.localai = lpb_grpc.BackendStub(channel)


@pytest.fixture(scope="module")
def doors(tmp_path_factory):
    """DoorsInProcess, shared by the module (the doors' answers to the same requests)."""
    path = make_tiny_model(
        tmp_path_factory.mktemp("doors"),
        "llama",
        num_layers=2,
        overrides=(("max_position_embeddings", CONTEXT),),
    )
    engine = Engine(Pipeline(None, None), EngineConfig(default_max_tokens=8))
    engine.start()
    cluster = Cluster(engine, model=str(path))
    cluster.load()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    add_to_server(RelayServicer(cluster), server)
    lpb_grpc.add_BackendServicer_to_server(LocalAIServicer(cluster), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    with TestClient(create_app(cluster)) as http:
        yield DoorsInProcess(cluster, path, http, channel)
    channel.close()
    server.stop(None).wait()
    # The engine thread's last lazy random state, evaluated where it was made: MLX
    # aborts the process at exit over an array left pending on a finished thread's stream.
    engine.call(lambda: mx.eval(mx.random.state)).result()
    cluster.free(shutdown=True)
    engine.join(10)


def _xs(n: int) -> str:
    """A raw prompt of exactly `n` tokens (one per 'x' with the tiny tokenizer)."""
    return "x" * n


# --- one max_tokens policy, every door ---------------------------------------------------


def _grpc(doors: DoorsInProcess, max_tokens: int) -> tuple[int, int, str]:
    params = pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    reply = doors.relay.Generate(pb.GenerateRequest(prompt=_xs(10), params=params), timeout=60)
    return reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.finish_reason


def _openai_chat(doors: DoorsInProcess, max_tokens: int) -> tuple[int, int, str]:
    body = {"messages": USER, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    reply = doors.http.post("/v1/chat/completions", json=body).json()
    usage = reply["usage"]
    return usage["prompt_tokens"], usage["completion_tokens"], reply["choices"][0]["finish_reason"]


def _openai_completion(doors: DoorsInProcess, max_tokens: int) -> tuple[int, int, str]:
    body = {"prompt": _xs(10), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    reply = doors.http.post("/v1/completions", json=body).json()
    usage = reply["usage"]
    return usage["prompt_tokens"], usage["completion_tokens"], reply["choices"][0]["finish_reason"]


def _responses(doors: DoorsInProcess, max_tokens: int) -> tuple[int, int, str]:
    body = {"input": "Hi", "max_output_tokens": max_tokens, "temperature": 0, "store": False}
    reply = doors.http.post("/v1/responses", json=body).json()
    usage = reply["usage"]
    reason = (reply["incomplete_details"] or {}).get("reason", reply["status"])
    return usage["input_tokens"], usage["output_tokens"], reason


def _anthropic(doors: DoorsInProcess, max_tokens: int) -> tuple[int, int, str]:
    body = {"model": doors.model, "messages": USER, "max_tokens": max_tokens, "temperature": 0}
    reply = doors.http.post("/v1/messages", json=body).json()
    usage = reply["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    return prompt, usage["output_tokens"], reply["stop_reason"]


def _ollama(doors: DoorsInProcess, max_tokens: int) -> tuple[int, int, str]:
    body = {
        "model": doors.model,
        "prompt": _xs(10),
        "raw": True,
        "stream": False,
        "options": {"num_predict": max_tokens, "temperature": 0},
    }
    reply = doors.http.post("/api/generate", json=body).json()
    return reply["prompt_eval_count"], reply["eval_count"], reply["done_reason"]


def _localai(doors: DoorsInProcess, max_tokens: int) -> tuple[int, int, str]:
    options = lpb.PredictOptions(Prompt=_xs(10), Tokens=max_tokens, IgnoreEOS=True)
    reply = doors.localai.Predict(options, timeout=60)
    return reply.prompt_tokens, reply.tokens, ""


# door -> (ask with max_tokens, what it calls an answer cut at max_tokens)
DOORS = {
    "grpc": (_grpc, "length"),
    "openai chat": (_openai_chat, "length"),
    "openai completions": (_openai_completion, "length"),
    "responses": (_responses, "max_output_tokens"),
    "anthropic": (_anthropic, "max_tokens"),
    "ollama": (_ollama, "length"),
    "localai": (_localai, ""),
}


@pytest.mark.parametrize("door", list(DOORS))
def test_max_tokens_over_the_context_ends_at_the_context(doors, door):
    ask, cut = DOORS[door]
    prompt, generated, reason = ask(doors, OVER)
    assert prompt + generated == CONTEXT and reason == cut, (prompt, generated, reason)
    prompt, generated, reason = ask(doors, 3)  # under it: max_tokens as asked
    assert generated == 3 and reason == cut, (prompt, generated, reason)


@pytest.mark.parametrize("door", list(DOORS))
def test_max_tokens_over_max_context_ends_at_max_context(doors, door, monkeypatch):
    bound = CONTEXT - 16
    engine = doors.cluster._engine
    # --max-context (caches unchecked: max_active 0)
    config = dataclasses.replace(engine.config, memory=memory.Plan(0, bound))
    monkeypatch.setattr(engine, "config", config)
    prompt, generated, _ = DOORS[door][0](doors, OVER)
    assert prompt + generated == bound, (prompt, generated)


def test_localai_context_size_caps_like_the_cluster_limits(doors):
    prompt = len(doors.cluster.render(GenerationRequest(prompt=_xs(10))).token_ids)
    try:
        doors.localai.LoadModel(lpb.ModelOptions(Model=doors.model, ContextSize=prompt + 3))
        assert _localai(doors, OVER)[1] == 3
        with pytest.raises(grpc.RpcError) as info:
            doors.localai.Predict(lpb.PredictOptions(Prompt=_xs(prompt + 3), Tokens=1))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "LoadModel's ContextSize is" in info.value.details()
    finally:
        doors.localai.LoadModel(lpb.ModelOptions(Model=doors.model))
    assert _localai(doors, OVER)[0:2] == (10, CONTEXT - 10)


REFUSED = {  # a prompt that leaves no room, on each door: (status, where the words are)
    "openai": ("/v1/completions", {"prompt": _xs(CONTEXT)}, ("error", "message")),
    "responses": ("/v1/responses", {"input": _xs(CONTEXT)}, ("error", "message")),
    "anthropic": (
        "/v1/messages",
        {"model": "", "max_tokens": 5, "messages": [{"role": "user", "content": _xs(CONTEXT)}]},
        ("error", "message"),
    ),
    "ollama": (
        "/api/generate",
        {"model": "", "prompt": _xs(CONTEXT), "raw": True, "stream": False},
        ("error",),
    ),
}


@pytest.mark.parametrize("door", list(REFUSED))
def test_a_prompt_that_leaves_no_room_is_refused(doors, door):
    path, body, where = REFUSED[door]
    reply = doors.http.post(path, json=body)
    assert reply.status_code == 400, reply.text
    words = reply.json()
    for key in where:
        words = words[key]
    assert f"the model's context is {CONTEXT}" in words, words


def test_a_prompt_that_leaves_no_room_is_refused_over_grpc(doors):
    for call in (
        lambda: doors.relay.Generate(pb.GenerateRequest(prompt=_xs(CONTEXT)), timeout=60),
        lambda: doors.localai.Predict(lpb.PredictOptions(Prompt=_xs(CONTEXT)), timeout=60),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"the prompt is {CONTEXT} tokens; the model's context is" in info.value.details()


def test_the_policy_takes_the_tightest_limit():
    limits = [Limit(100, "the model's context"), Limit(0, "unset"), Limit(60, "a cap")]
    assert cap(5, 10, limits) == 5
    assert cap(500, 10, limits) == 50
    assert cap(500, 59, limits) == 1
    with pytest.raises(InvalidRequest, match="the prompt is 60 tokens; a cap is 60"):
        cap(1, 60, limits)
    assert cap(7, 10, []) == 7


# --- the facade: what the doors read ------------------------------------------------------


def test_health_status_and_metrics_read_the_cluster(doors):
    http = doors.http
    _grpc(doors, 2)  # (some steps to count)
    health = http.get("/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "state": "serving", "model": doors.model, "ranks": 1}
    status = http.get("/v1/status").json()
    assert status["world_size"] == 1 and status["state"] == "serving"
    assert status["model"] == doors.model and status["num_layers"] == 2
    assert [r["rank"] for r in status["ranks"]] == [0] and status["ranks"][0]["layer_end"] == 2
    assert status["hop_mode"] == "none (one rank)" and status["failure"] == ""
    assert status["max_active"] == 8 and status["heartbeat_timeout_s"] == 3.0
    assert status["tokens"]["prefill"] > 0 and status["tokens"]["decode"] > 0
    assert status["ring_steps"]["decode"]["steps"] > 0
    assert status["ranks"][0]["steps"] == sum(s["steps"] for s in status["ring_steps"].values())
    assert status["layout"] == {
        "stages": 1,
        "tensor_parallel": 1,
        "tensor_backend": "",
        "note": "",
        "chosen_at_load": False,
        "all_sum_seconds": 0.0,
        "layer_seconds": 0.0,
        "pipeline_token_seconds": 0.0,
        "tensor_token_seconds": 0.0,
        "pair_all_sum_seconds": 0.0,
        "grid_token_seconds": 0.0,
    }
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    assert families["mlx_relay:engine_serving"].samples[0].value == 1
    assert families["mlx_relay:tensor_parallel"].samples[0].value == 1
    assert families["mlx_relay:pipeline_stages"].samples[0].value == 1
    assert families["mlx_relay:num_requests_running"].samples[0].value == 0
    kinds = {s.labels["kind"] for s in families["mlx_relay:ring_steps"].samples}
    assert {"prefill", "decode"} <= kinds


def test_model_listings_read_the_loaded_model(doors):
    http = doors.http
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [doors.model]
    assert http.post("/tokenize", json={"prompt": _xs(4)}).json()["max_model_len"] == CONTEXT
    (tag,) = http.get("/api/tags").json()["models"]
    assert tag["name"] == doors.model and tag["size"] > 0 and tag["details"]["family"] == "llama"
    (ps,) = http.get("/api/ps").json()["models"]
    assert ps["context_length"] == CONTEXT and ps["digest"] == tag["digest"]
    show = http.post("/api/show", json={"model": doors.model}).json()
    assert show["model_info"]["llama.context_length"] == CONTEXT
    assert doors.localai.Health(lpb.HealthMessage()).message == b"OK"
    state = doors.localai.Status(lpb.HealthMessage()).state
    assert state == lpb.StatusResponse.READY


# --- one helper for each parsing job ------------------------------------------------------


def test_json_fields_are_parsed_by_one_helper():
    assert json_field("  ", "tools", list) is None
    assert json_field('{"a": 1}', "kwargs", dict) == {"a": 1}
    with pytest.raises(InvalidRequest, match="tools is not valid JSON"):
        json_field("[", "tools", list)
    with pytest.raises(InvalidRequest, match="tools must be a JSON list"):
        json_field("{}", "tools", list)
    with pytest.raises(InvalidRequest, match="response_format must be a JSON object with"):
        json_field("[]", "response_format", dict, "a JSON object with a 'type'")


def test_logit_bias_is_parsed_by_one_helper(doors):
    assert logit_bias({"5": -100, 7: 1.5}) == {5: -100.0, 7: 1.5}
    with pytest.raises(InvalidRequest, match="LogitBias must map token ids to numbers"):
        logit_bias({"x": 1}, "LogitBias")
    reply = doors.http.post("/v1/chat/completions", json={"messages": USER, "logit_bias": {"x": 1}})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "logit_bias"
    assert "logit_bias must map token ids to numbers" in reply.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as info:
        doors.localai.Predict(lpb.PredictOptions(Prompt="hi", LogitBias='{"x": 1}'), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "LogitBias must map token ids to numbers" in info.value.details()


# --- a non-streaming answer is its stream folded ------------------------------------------


def _events(text: str) -> list[tuple[str, dict]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines.get("event", ""), json.loads(lines["data"])))
    return out


def test_anthropic_stream_and_answer_agree(doors):
    body = {"model": doors.model, "messages": USER, "max_tokens": 6, "temperature": 0}
    whole = doors.http.post("/v1/messages", json=body).json()
    streamed = _events(doors.http.post("/v1/messages", json={**body, "stream": True}).text)
    names = [name for name, _ in streamed]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    text = "".join(d["delta"].get("text", "") for n, d in streamed if n == "content_block_delta")
    assert text == whole["content"][0]["text"] and whole["stop_reason"] == "max_tokens"
    assert streamed[-2][1]["usage"]["output_tokens"] == whole["usage"]["output_tokens"] == 6


def test_responses_stream_and_answer_agree(doors):
    body = {"input": "Hi", "max_output_tokens": 6, "temperature": 0, "store": False}
    whole = doors.http.post("/v1/responses", json=body).json()
    streamed = _events(doors.http.post("/v1/responses", json={**body, "stream": True}).text)
    names = [name for name, _ in streamed]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] == "response.incomplete"
    text = "".join(d["delta"] for n, d in streamed if n == "response.output_text.delta")
    assert text == whole["output"][0]["content"][0]["text"]

    def content(output: list[dict]) -> list:
        return [item["content"] for item in output]  # (item ids are made per answer)

    assert content(streamed[-1][1]["response"]["output"]) == content(whole["output"])


def test_a_folded_stream_is_the_grpc_answer(doors):
    request = pb.GenerateRequest(prompt=_xs(5), params=pb.SamplingParams(max_tokens=6))
    whole = Chunk()
    for chunk in doors.relay.GenerateStream(request, timeout=60):
        whole.add(Chunk(text=chunk.text, token_ids=list(chunk.token_ids)))
    reply = doors.relay.Generate(request, timeout=60)
    assert (whole.text, whole.token_ids) == (reply.text, list(reply.token_ids))
    chat = doors.http.post(
        "/v1/completions", json={"prompt": _xs(5), "max_tokens": 6, "temperature": 0}
    ).json()
    assert chat["choices"][0]["text"] == reply.text


# --- cache_salt, every door --------------------------------------------------------------


def _hits(doors: DoorsInProcess) -> float:
    """Prompt tokens the HTTP doors found in a cache so far (/metrics)."""
    text = doors.http.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return sum(s.value for s in families["mlx_relay:prefix_cache_hits"].samples)


def _salted_grpc(doors: DoorsInProcess, text: str, salt: str) -> int:
    params = pb.SamplingParams(max_tokens=2)
    request = pb.GenerateRequest(prompt=text, params=params, cache_salt=salt)
    return doors.relay.Generate(request, timeout=60).usage.cached_tokens


def _salted_completion(doors: DoorsInProcess, text: str, salt: str) -> int:
    body = {"prompt": text, "max_tokens": 2, "cache_salt": salt}
    usage = doors.http.post("/v1/completions", json=body).json()["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"]


def _salted_chat(doors: DoorsInProcess, text: str, salt: str) -> int:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2, "cache_salt": salt}
    usage = doors.http.post("/v1/chat/completions", json=body).json()["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"]


def _salted_responses(doors: DoorsInProcess, text: str, salt: str) -> int:
    body = {"input": text, "max_output_tokens": 2, "store": False, "cache_salt": salt}
    usage = doors.http.post("/v1/responses", json=body).json()["usage"]
    return usage["input_tokens_details"]["cached_tokens"]


def _salted_anthropic(doors: DoorsInProcess, text: str, salt: str) -> int:
    messages = [{"role": "user", "content": text}]
    body = {"model": doors.model, "messages": messages, "max_tokens": 2, "cache_salt": salt}
    return doors.http.post("/v1/messages", json=body).json()["usage"]["cache_read_input_tokens"]


def _salted_ollama(doors: DoorsInProcess, text: str, salt: str) -> int:
    """(Ollama has no cached-tokens field: the request's share of /metrics' hits.)"""
    before = _hits(doors)
    body = {"model": doors.model, "prompt": text, "raw": True, "stream": False}
    body |= {"options": {"num_predict": 2}, "cache_salt": salt}
    reply = doors.http.post("/api/generate", json=body)
    assert reply.status_code == 200, reply.text
    return int(_hits(doors) - before)


# door -> ask it for a prompt with a salt: the prompt tokens it reports found in a cache
SALTED = {
    "grpc": _salted_grpc,
    "openai completions": _salted_completion,
    "openai chat": _salted_chat,
    "responses": _salted_responses,
    "anthropic": _salted_anthropic,
    "ollama": _salted_ollama,
}


@pytest.mark.parametrize("door", list(SALTED))
def test_every_door_takes_a_cache_salt_and_salts_share_no_cached_prefix(doors, door):
    """vLLM's `cache_salt`: a prompt is served from a kept cache only of its own salt
    (tenants that must not share prefixes, RAM tier here; the disk tier keys its blocks
    by it too, test_prompt_store.py)."""
    ask = SALTED[door]
    text = door.replace(" ", "") + "y" * 20  # (one prompt per door: no other test's cache)
    assert ask(doors, text, "tenant-a") == 0
    assert ask(doors, text, "tenant-a") > 0
    assert ask(doors, text, "tenant-b") == 0
    assert ask(doors, text, "tenant-b") > 0


def test_status_and_metrics_show_the_ram_tier_its_bytes_and_what_it_served(doors):
    """The prompt cache's tiers in /v1/status and /metrics: entries, tokens, bytes (at
    the model's cache bytes per token) and the prompt tokens each served, of every door."""

    def ram() -> tuple[dict, int]:
        status = doors.http.get("/v1/status").json()
        tiers = {t["tier"]: t for t in status["prompt_cache_tiers"]}
        assert set(tiers) == {"ram"}  # (no --prompt-cache-dir here)
        return tiers["ram"], status["prompt_tokens"]

    before, seen = ram()
    text = "tiers" + "z" * 20
    first = _salted_grpc(doors, text, "tiers")
    again = _salted_grpc(doors, text, "tiers")
    after, now_seen = ram()
    prompt = doors.relay.Tokenize(pb.TokenizeRequest(text=text), timeout=60).token_ids
    assert (first, again) == (0, len(prompt) - 1)
    assert now_seen - seen == 2 * len(prompt)
    assert after["hit_tokens"] - before["hit_tokens"] == again
    assert after["hit_rate"] == pytest.approx(after["hit_tokens"] / now_seen)
    per_token = memory.bytes_per_token(Path(doors.model), [(0, 2)])
    assert after["entries"] >= 1 and after["tokens"] > 0
    assert after["bytes"] == int(after["tokens"] * per_token) > 0
    families = {f.name: f for f in text_string_to_metric_families(doors.http.get("/metrics").text)}
    by_tier = {s.labels["tier"]: s.value for s in families["mlx_relay:prompt_cache_bytes"].samples}
    hits = families["mlx_relay:prompt_cache_hit_tokens"].samples
    assert by_tier == {"ram": after["bytes"]}
    assert {s.labels["tier"]: s.value for s in hits} == {"ram": after["hit_tokens"]}
