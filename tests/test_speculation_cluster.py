"""Speculative decoding over real ranks: a verify step's positions go through every
rank as one step, rank 0 keeps what agrees, and every rank cuts the rest back.

- A draft model on rank 0 (`--draft-model`, fixed K): the tokens equal mlx-lm's own
  speculative generator's with the same draft, K and seed, greedy and seeded, on 2 and
  3 ranks (1 rank: tests/test_speculation.py).
- Prompt lookup (`--draft ngram --draft-fixed`) on the default model through the OpenAI
  door with the openai client: greedy output equals plain greedy decoding; the usage,
  /v1/status and /metrics count the proposals; a request can turn it off. (Fixed K:
  adaptive drafting turns itself off at load on this CPU, where a step of 5 positions of
  the default model costs 5 steps: tests/test_speculation.py checks that rule.)
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from conftest import free_ports
from oracle import chat_tokens, mlx_lm_tokens
from support import meanwhile
from tiny_models import make_tiny_model

from mlx_relay.model.default_model import resolve_model
from mlx_relay.protocol import relay_pb2 as pb

pytestmark = pytest.mark.cluster

K = 3
CHATS = ("The quick brown fox jumps over the lazy dog.", "hello hello hello")


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("target"), "llama", num_layers=4)


@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> Path:
    """A draft that agrees with the target now and then: both paths (all kept, cut
    back) run."""
    return make_tiny_model(tmp_path_factory.mktemp("draft"), "llama", num_layers=1, seed=7)


def _chat(text: str, seed: int | None, max_tokens: int) -> pb.GenerateRequest:
    params = pb.SamplingParams(max_tokens=max_tokens)
    if seed is not None:
        params.temperature, params.top_p, params.seed = 0.9, 0.95, seed
    return pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=text)], params=params)


@pytest.mark.parametrize("ranks, layers", [(2, "2,2"), (3, "1,2,1")])
def test_draft_model_equals_mlx_lms_speculative_generator(
    cluster_factory, target, draft, ranks, layers
):
    running = cluster_factory(
        target,
        ranks,
        "--draft-model",
        str(draft),
        "--num-draft-tokens",
        str(K),
        "--draft-fixed",
        layers=layers,
    )
    for text in CHATS:
        for seed in (None, 5):
            response = running.client.generate(_chat(text, seed, 16))
            prompt = chat_tokens(target, [{"role": "user", "content": text}])
            sampler = {"temp": 0.9, "top_p": 0.95} if seed is not None else None
            expected = mlx_lm_tokens(
                target, prompt, 16, seed=seed, sampler=sampler, draft=draft, num_draft_tokens=K
            )
            assert list(response.token_ids) == expected, running.logs()
            assert response.usage.draft_tokens >= K
    status = running.client.status()
    assert status.speculation.source == "model" and status.speculation.rounds > 0


@pytest.mark.default_model
def test_prompt_lookup_on_the_default_model_through_the_openai_door(cluster_factory):
    port = free_ports(1)[0]
    text = "Repeat exactly: The quick brown fox jumps over the lazy dog, twice over."

    def ask_the_cluster():
        served = cluster_factory(
            "default", 2, "--draft", "ngram", "--draft-fixed", "--http-address", f"127.0.0.1:{port}"
        )
        return served, served.client.generate(_chat(text, None, 40))

    with meanwhile(ask_the_cluster, deadline=600) as asked:
        path = resolve_model("default", progress=False)
        prompt = chat_tokens(path, [{"role": "user", "content": text}])
        expected = mlx_lm_tokens(path, prompt, 40)
    running, response = asked.result(timeout=600)
    assert list(response.token_ids) == expected, running.logs()
    assert response.usage.accepted_draft_tokens > len(response.token_ids) / 3

    base = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
    messages = [{"role": "user", "content": text}]
    answer = client.chat.completions.create(
        model="default", messages=messages, max_tokens=40, temperature=0
    )
    assert answer.choices[0].message.content == response.text
    details = answer.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0
    assert details.rejected_prediction_tokens >= 0
    off = client.chat.completions.create(
        model="default",
        messages=messages,
        max_tokens=40,
        temperature=0,
        extra_body={"num_draft_tokens": 0},
    )
    assert off.choices[0].message.content == response.text
    assert off.usage.completion_tokens_details.accepted_prediction_tokens == 0
    status = httpx.get(f"{base}/v1/status").json()["speculation"]
    assert status["source"] == "ngram" and status["acceptance_rate"] > 0.3, status
    metrics = httpx.get(f"{base}/metrics").text
    assert "mlx_relay:spec_accepted_draft_tokens_total" in metrics
    assert running.client.status().speculation.tokens_per_round > 1.3
