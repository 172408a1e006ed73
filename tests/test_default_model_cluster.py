"""The embedded default model through a real 2-rank cluster: greedy text through the
gRPC, OpenAI, Anthropic and Ollama doors equals single-process mlx-lm's."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from oracle import PARIS_QUESTION, PARIS_TOKENS, chat_tokens, mlx_lm_tokens, tokenizer_for
from support import meanwhile

from mlx_relay.model.default_model import resolve_model
from mlx_relay.protocol import relay_pb2 as pb

pytestmark = [pytest.mark.cluster, pytest.mark.default_model]

QUESTION = PARIS_QUESTION
MESSAGES = [{"role": "user", "content": QUESTION}]
MAX_TOKENS = PARIS_TOKENS


@pytest.fixture(scope="module")
def default_path():
    return resolve_model("default")


@pytest.fixture(scope="module")
def expected(default_path) -> list[int]:
    """mlx-lm's greedy answer, once for every door."""
    return mlx_lm_tokens(default_path, chat_tokens(default_path, MESSAGES), MAX_TOKENS)


def test_two_ranks_answer_paris_exactly_like_mlx_lm(default_path, expected, default_cluster):
    running, _ = default_cluster
    response = running.client.generate(
        pb.GenerateRequest(
            messages=[pb.ChatMessage(role="user", content=QUESTION)],
            params=pb.SamplingParams(max_tokens=MAX_TOKENS),
        )
    )
    text = tokenizer_for(default_path).decode(expected)
    assert "Paris" in response.text
    assert response.finish_reason == "stop"
    assert list(response.token_ids) == expected and response.text == text
    status = running.client.status()
    # The default split is balanced: rank 0 also runs the LM head (8 layers' worth here).
    assert [(r.layer_start, r.layer_end) for r in status.ranks] == [(0, 11), (11, 30)]


def test_greedy_text_over_http_equals_mlx_lm(default_path, expected, default_cluster):
    _, port = default_cluster
    text = tokenizer_for(default_path).decode(expected)
    base = f"http://127.0.0.1:{port}"
    oai = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    chat = oai.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0
    )
    assert chat.choices[0].message.content == text
    streamed = oai.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=MAX_TOKENS, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
    claude = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
    message = claude.messages.create(model="default", max_tokens=MAX_TOKENS, messages=MESSAGES)
    assert message.content[0].text == text
    ollama = httpx.post(
        base + "/api/chat",
        json={
            "model": "default",
            "messages": MESSAGES,
            "stream": False,
            "options": {"num_predict": MAX_TOKENS, "temperature": 0},
        },
        timeout=120,
    ).json()
    assert ollama["message"]["content"] == text
    assert ollama["eval_count"] == len(expected)


def test_http_logprobs_name_mlx_lms_tokens_one_by_one(default_path, expected, default_cluster):
    """Where an HTTP door exposes tokens (OpenAI's logprobs), they are mlx-lm's, token by
    token, whole and streamed: a check of ids, not only of the text they join into."""
    _, port = default_cluster
    tokenizer = tokenizer_for(default_path)
    pieces = [tokenizer.decode([t]) for t in expected]
    oai = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    ask = dict(model="default", messages=MESSAGES, max_tokens=MAX_TOKENS, logprobs=True)
    whole = oai.chat.completions.create(**ask)
    assert [e.token for e in whole.choices[0].logprobs.content] == pieces
    assert all(e.logprob <= 0 for e in whole.choices[0].logprobs.content)
    streamed = [
        e.token
        for chunk in oai.chat.completions.create(**ask, stream=True)
        if chunk.choices and chunk.choices[0].logprobs
        for e in chunk.choices[0].logprobs.content
    ]
    assert streamed == pieces


LONG_MESSAGES = [
    {
        "role": "user",
        "content": "Write a long, detailed history of the city of Rome, century by century.",
    }
]
LONG_TOKENS = 200


def test_three_uneven_ranks_answer_200_tokens_exactly_like_mlx_lm(default_path, cluster_factory):
    """The real model, split unevenly over 3 ranks (8, 12 and 10 of its 30 layers): 200
    greedy token ids equal single-process mlx-lm's, every one (no early EOS hides a
    divergence late in the answer: the answer runs to the limit)."""

    def ask_the_cluster():
        running = cluster_factory(default_path, 3, layers="8,12,10")
        status = running.client.status()
        # (~3 tokens a second here: 200 tokens beside other test files may outlast the
        # client's 120 s deadline; this one is only a bound against a hang)
        response = running.client.stub.Generate(
            pb.GenerateRequest(
                messages=[pb.ChatMessage(**m) for m in LONG_MESSAGES],
                params=pb.SamplingParams(max_tokens=LONG_TOKENS),
            ),
            timeout=900,
        )
        return status, response

    with meanwhile(ask_the_cluster) as asked:
        expected = mlx_lm_tokens(
            default_path, chat_tokens(default_path, LONG_MESSAGES), LONG_TOKENS
        )
    assert len(expected) == LONG_TOKENS, "mlx-lm ended early: pick a prompt with a longer answer"
    status, response = asked.result(timeout=900)
    assert [(r.layer_start, r.layer_end) for r in status.ranks] == [(0, 8), (8, 20), (20, 30)]
    got = list(response.token_ids)
    first = next((i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b), None)
    assert got == expected, f"first difference at token {first}"
    assert response.finish_reason == "length"
    assert response.text == tokenizer_for(default_path).decode(expected)
