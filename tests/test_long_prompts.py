"""A long prompt never kills the cluster, and a stuck rank is still named in time.

A prompt of ~1,700 tokens goes round 2 and 3 unevenly split ranks in chunks, several in
flight at once, with a step timeout far below what the whole prefill takes: every step
is timed from when it could start and allowed what the cluster's measured pace says it
should take (coordinator/pace.py), so the answer is mlx-lm's, token for token. A rank
stopped or killed in the middle of such a prefill still ends the request as
UNAVAILABLE, naming it.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import threading
import time
from pathlib import Path

import grpc
import pytest
from conftest import start_cluster
from oracle import chat_tokens, mlx_lm_tokens
from tiny_models import make_tiny_model

from mlx_relay.protocol import relay_pb2 as pb

HOST = socket.gethostname()
HEARTBEAT_TIMEOUT = 3.0  # the default of --heartbeat-timeout
STEP_TIMEOUT = "0.5"  # far below the prefill's whole time (several seconds here)
WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls keep watch".split()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """Wide enough that a prompt chunk takes a CPU rank a noticeable time."""
    return make_tiny_model(
        tmp_path_factory.mktemp("llama-128"), "llama", num_layers=4, hidden_size=128
    )


def _haystack(words: int, seed: int = 0) -> list[dict]:
    """A chat whose message hides one sentence (the needle) in the middle of noise."""
    rng = random.Random(seed)
    hay = [rng.choice(WORDS) for _ in range(words)]
    hay.insert(words // 2, "The secret password is violet-42.")
    text = " ".join(hay) + "\nWhat is the secret password?"
    return [{"role": "user", "content": text}]


def _request(messages: list[dict], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
        params=pb.SamplingParams(max_tokens=max_tokens),
    )


# Three ranks have every kind of hop two have (and a middle rank's); two are `exhaustive`.
@pytest.mark.parametrize(
    "ranks, layers", [pytest.param(2, "1,3", marks=pytest.mark.exhaustive), (3, "1,1,2")]
)
def test_a_long_prompt_on_uneven_ranks_with_a_short_step_timeout(model, tmp_path, ranks, layers):
    messages = _haystack(700)
    prompt = chat_tokens(model, messages)
    assert 1500 < len(prompt) < 2000, len(prompt)  # (the model's context is 2,048)
    running = start_cluster(
        model,
        ranks,
        tmp_path / "logs",
        "--step-timeout",
        STEP_TIMEOUT,
        "--prefill-chunk",
        "256",  # (several chunks in flight at once)
        layers=layers,
    )
    try:
        started = time.monotonic()
        tokens = list(running.client.generate(_request(messages, 8)).token_ids)
        took = time.monotonic() - started
        assert tokens == mlx_lm_tokens(model, prompt, 8), running.logs()
    finally:
        running.stop()
    print(f"\n{ranks} ranks ({layers}), {len(prompt)} prompt tokens: {took:.1f} s")


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory) -> Path:
    """A context of 8,192 tokens, narrow and with one attention head: 7,000 prompt tokens'
    scores over each other (a matrix per head and layer) are most of their work on a CPU,
    4 heads' took mlx-lm 11 s here, one head's 3 s."""
    return make_tiny_model(
        tmp_path_factory.mktemp("llama-8k"),
        "llama",
        num_layers=3,
        hidden_size=64,
        overrides=(
            ("max_position_embeddings", 8192),
            ("num_attention_heads", 1),
            ("num_key_value_heads", 1),
        ),
    )


def test_needles_from_300_to_7000_tokens_on_three_ranks(long_context_model, tmp_path):
    """Issue 37: prompts that fill most of the context, several chunks in flight at once,
    greedy, equal to mlx-lm at every length."""
    model = long_context_model
    running = start_cluster(model, 3, tmp_path / "logs", "--prefill-chunk", "512")
    try:
        for words in (120, 2750):  # (~350 and ~7,000 tokens)
            messages = _haystack(words, seed=words)
            prompt = chat_tokens(model, messages)
            started = time.monotonic()
            tokens = list(running.client.generate(_request(messages, 6)).token_ids)
            took = time.monotonic() - started
            assert tokens == mlx_lm_tokens(model, prompt, 6), (len(prompt), running.logs())
            print(f"\n3 ranks, {len(prompt)} prompt tokens: {took:.1f} s")
    finally:
        running.stop()


def _prefilling(running, messages: list[dict]) -> tuple[list, threading.Thread]:
    """A long request sent and in the middle of its prefill: [error or None], its thread."""
    outcome: list = []

    def run() -> None:
        try:
            list(running.client.stream(_request(messages, 4)))
            outcome.append(None)
        except grpc.RpcError as e:
            outcome.append((e, time.monotonic()))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    # Wait on the condition itself: the cluster's status shows the request in its prefill,
    # some of the prompt sent round the ring and not all of it.
    deadline = time.monotonic() + 120
    while True:
        assert not outcome, f"the request ended before its prefill was seen: {outcome}"
        phases = [
            (r.phase, r.prefilled_tokens, r.prompt_tokens) for r in running.client.status().requests
        ]
        if any(phase == "prefill" and 0 < done < total for phase, done, total in phases):
            return outcome, thread
        assert time.monotonic() < deadline, f"no prefill under way within 120 s: {phases}"
        time.sleep(0.02)


@pytest.mark.parametrize("how", ["SIGSTOP", "SIGKILL"])
def test_a_rank_stopped_or_killed_mid_prefill_is_named(model, tmp_path, how):
    running = start_cluster(
        model, 3, tmp_path / "logs", "--step-timeout", STEP_TIMEOUT, layers="1,1,2"
    )
    worker = running.cluster.procs[2]
    try:
        outcome, thread = _prefilling(running, _haystack(700, seed=1))
        at = time.monotonic()
        os.kill(worker.pid, getattr(signal, how))
        thread.join(HEARTBEAT_TIMEOUT + 10)
        assert outcome and outcome[0] is not None, "the request did not fail"
        error, when = outcome[0]
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert f"rank 2 ({HOST})" in error.details(), error.details()
        # What found the loss, from the error's words; the time only a generous deadline.
        # (A stopped rank is found by its silence or by the step it holds: whichever
        # comes first, which a busy machine decides: seen both ways under a busy core.)
        found = (
            ("side-channel connection closed",) if how == "SIGKILL" else ("no heartbeat", "overdue")
        )
        assert any(f in error.details() for f in found), error.details()
        assert when - at < 60, (when - at, error.details())
    finally:
        worker.send_signal(signal.SIGCONT)  # (none if it has exited)
        running.stop()
    print(f"\n{how} of rank 2 mid-prefill: UNAVAILABLE after {when - at:.2f} s")
