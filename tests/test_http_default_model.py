"""The default model end to end over HTTP: greedy text through the OpenAI, Anthropic and
Ollama doors equals the gRPC door's and single-process mlx-lm's."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from oracle import chat_tokens, mlx_lm_tokens, tokenizer_for

from mlx_relay.launch.local import free_ports
from mlx_relay.model.default_model import resolve_model
from mlx_relay.protocol import relay_pb2 as pb

pytestmark = [pytest.mark.cluster, pytest.mark.default_model]

QUESTION = "What is the capital of France? Answer in one sentence."
MAX_TOKENS = 24


def test_greedy_text_equals_grpc_and_mlx_lm(cluster_factory):
    path = resolve_model("default")
    port = free_ports(1)[0]
    running = cluster_factory("default", 2, "--http-address", f"127.0.0.1:{port}")
    messages = [{"role": "user", "content": QUESTION}]
    expected = mlx_lm_tokens(path, chat_tokens(path, messages), MAX_TOKENS)
    text = tokenizer_for(path).decode(expected)
    grpc_reply = running.client.generate(
        pb.GenerateRequest(
            messages=[pb.ChatMessage(role="user", content=QUESTION)],
            params=pb.SamplingParams(max_tokens=MAX_TOKENS),
        )
    )
    assert list(grpc_reply.token_ids) == expected and grpc_reply.text == text
    assert "Paris" in text

    base = f"http://127.0.0.1:{port}"
    oai = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    chat = oai.chat.completions.create(
        model="default", messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    assert chat.choices[0].message.content == text
    streamed = oai.chat.completions.create(
        model="default", messages=messages, max_tokens=MAX_TOKENS, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
    claude = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
    message = claude.messages.create(model="default", max_tokens=MAX_TOKENS, messages=messages)
    assert message.content[0].text == text
    ollama = httpx.post(
        base + "/api/chat",
        json={
            "model": "default",
            "messages": messages,
            "stream": False,
            "options": {"num_predict": MAX_TOKENS, "temperature": 0},
        },
        timeout=120,
    ).json()
    assert ollama["message"]["content"] == text
    assert ollama["eval_count"] == len(expected)
