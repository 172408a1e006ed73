"""The embedded default model through a real 2-rank cluster."""

from __future__ import annotations

import pytest
from oracle import chat_tokens, mlx_lm_tokens

from mlx_relay.model.default_model import resolve_model
from mlx_relay.protocol import relay_pb2 as pb

pytestmark = [pytest.mark.cluster, pytest.mark.default_model]

QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def default_path():
    return resolve_model("default")


def test_two_ranks_answer_paris_exactly_like_mlx_lm(default_path, cluster_factory):
    running = cluster_factory("default", 2)
    messages = [{"role": "user", "content": QUESTION}]
    response = running.client.generate(
        pb.GenerateRequest(
            messages=[pb.ChatMessage(role="user", content=QUESTION)],
            params=pb.SamplingParams(max_tokens=24),
        )
    )
    assert "Paris" in response.text
    assert response.finish_reason == "stop"
    expected = mlx_lm_tokens(default_path, chat_tokens(default_path, messages), 24)
    assert list(response.token_ids) == expected
    status = running.client.status()
    # The default split is balanced: rank 0 also runs the LM head (8 layers' worth here).
    assert [(r.layer_start, r.layer_end) for r in status.ranks] == [(0, 11), (11, 30)]
