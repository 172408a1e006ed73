"""Prefix reuse: a finished request's KV caches serve a later prompt that starts the same way.

The oracle is mlx-lm with a prompt cache: generate the first request into a cache, cut
the cache back to the prefix the second prompt shares with it, and generate the second
request's remaining tokens from there. The cluster must give exactly those tokens.
"""

from __future__ import annotations

import pytest
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from oracle import _load, chat_tokens, mlx_lm_continue, mlx_lm_tokens

from mlx_relay.coordinator.slots import common_prefix_len
from mlx_relay.protocol import relay_pb2 as pb

pytestmark = pytest.mark.cluster

FIRST = [{"role": "user", "content": "Tell me about the sea."}]
MAX_TOKENS = 10


def _mlx_lm_second_turn(model, first: list[int], second: list[int]) -> tuple[list[int], int]:
    """mlx-lm's tokens for `second` after `first` ran into the same cache, and how many
    of `second`'s tokens that cache held."""
    cache = make_prompt_cache(_load(str(model))[0])
    generated = mlx_lm_continue(model, cache, first, MAX_TOKENS)
    held = (first + generated)[: cache[0].offset]
    shared = min(common_prefix_len(held, second), len(second) - 1)
    trim_prompt_cache(cache, cache[0].offset - shared)
    return mlx_lm_continue(model, cache, second[shared:], MAX_TOKENS), shared


def _held(response: pb.GenerateResponse) -> int:
    """Tokens a finished request's caches hold: its prompt and every token it sampled, the
    last one (and an end-of-sequence token) included: the step that feeds a token back
    goes out before the host reads it, so the host learns the sequence has ended only
    after that step was launched."""
    fed = len(response.token_ids) + (response.finish_reason == "stop")
    return response.usage.prompt_tokens + fed


def _chat(messages: list[dict]) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        messages=[pb.ChatMessage(**m) for m in messages],
        params=pb.SamplingParams(max_tokens=MAX_TOKENS),
    )


def test_next_turn_of_a_chat_reuses_the_first_turns_caches(tiny_model, cluster_pool):
    model = tiny_model("llama", 5)
    running = cluster_pool.serving(model, 2, fresh=True)
    first = running.client.generate(_chat(FIRST))
    assert first.usage.cached_tokens == 0
    prompt = chat_tokens(model, FIRST)
    assert list(first.token_ids) == mlx_lm_tokens(model, prompt, MAX_TOKENS)

    turn = [
        *FIRST,
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And the mountains?"},
    ]
    second = running.client.generate(_chat(turn))
    expected, shared = _mlx_lm_second_turn(model, prompt, chat_tokens(model, turn))
    assert shared >= len(prompt)  # at least the whole first prompt
    assert second.usage.cached_tokens == shared
    assert list(second.token_ids) == expected

    # The same prompt again: everything but its last token comes from the cache.
    again = running.client.generate(_chat(FIRST))
    assert again.usage.cached_tokens == len(prompt) - 1
    assert again.token_ids == first.token_ids
    # It started from a copy, so every conversation's caches stay for a next turn; the
    # second turn took the first one's over only if it kept all of it.
    kept = [second, again] if shared == _held(first) else [first, second, again]
    status = running.client.status()
    assert (status.cached_prompts, status.cached_prompt_tokens) == (
        len(kept),
        sum(_held(r) for r in kept),
    )
    running.client.stub.Free(pb.FreeRequest(), timeout=30)
    assert running.client.status().cached_prompts == 0


def test_conversations_sharing_a_system_prompt_keep_their_own_caches(tiny_model, cluster_pool):
    """The second conversation copies the shared part; the first one's caches stay whole."""
    model = tiny_model("llama", 5)
    running = cluster_pool.serving(model, 2, fresh=True)
    system = {"role": "system", "content": "You are a terse assistant for a ship's crew."}
    a = [system, {"role": "user", "content": "How deep is the harbour?"}]
    b = [system, {"role": "user", "content": "When is high tide?"}]
    first_a = running.client.generate(_chat(a))
    first_b = running.client.generate(_chat(b))
    prompt_a, prompt_b = chat_tokens(model, a), chat_tokens(model, b)
    expected_b, shared = _mlx_lm_second_turn(model, prompt_a, prompt_b)
    assert 0 < first_b.usage.cached_tokens == shared < len(prompt_b) - 1
    assert list(first_b.token_ids) == expected_b
    assert running.client.status().cached_prompts == 2

    next_a = [
        *a,
        {"role": "assistant", "content": first_a.text},
        {"role": "user", "content": "Thanks."},
    ]
    reply = running.client.generate(_chat(next_a))
    expected, shared = _mlx_lm_second_turn(model, prompt_a, chat_tokens(model, next_a))
    assert reply.usage.cached_tokens == shared >= len(prompt_a)
    assert list(reply.token_ids) == expected


@pytest.mark.parametrize(
    "options",
    [("auto",), ("eager",), ("eager", "--steps-in-flight", "4")],
    ids=["auto", "eager", "eager-4-in-flight"],
)
def test_reuse_survives_concurrent_decoding(tiny_model, cluster_pool, options):
    """Caches parked out of a batched decode group are the sequence's own rows (also with
    a group and a step in flight more than there are ranks)."""
    model = tiny_model("qwen3", 4)
    running = cluster_pool.serving(model, 3, "--hop-mode", *options, fresh=True)
    prompts = [
        [{"role": "user", "content": f"Question {i}: why is the sky blue?"}] for i in range(4)
    ]
    calls = [running.client.stream(_chat(p)) for p in prompts]
    alone = [[t for chunk in call for t in chunk.token_ids] for call in calls]
    for p, tokens in zip(prompts, alone, strict=True):
        assert tokens == mlx_lm_tokens(model, chat_tokens(model, p), MAX_TOKENS)
    again = [running.client.generate(_chat(p)) for p in prompts]
    for p, reply, tokens in zip(prompts, again, alone, strict=True):
        assert reply.usage.cached_tokens == len(chat_tokens(model, p)) - 1
        assert list(reply.token_ids) == tokens


def test_prompt_cache_tokens_bounds_what_is_kept(tiny_model, cluster_pool):
    model = tiny_model("llama", 5)
    prompts = [[{"role": "user", "content": f"Tell me about topic number {i}."}] for i in range(3)]
    budget = len(chat_tokens(model, prompts[0])) + MAX_TOKENS  # room for one finished request
    running = cluster_pool.serving(model, 2, "--prompt-cache-tokens", str(budget), fresh=True)
    replies = [running.client.generate(_chat(p)) for p in prompts]
    status = running.client.status()
    assert (status.cached_prompts, status.cached_prompt_tokens) == (1, _held(replies[-1]))
    newest = running.client.generate(_chat(prompts[-1]))
    assert newest.usage.cached_tokens == len(chat_tokens(model, prompts[-1])) - 1
    oldest = running.client.generate(_chat(prompts[0]))  # its caches were dropped
    assert 0 < oldest.usage.cached_tokens < len(chat_tokens(model, prompts[0])) - 1
    assert oldest.token_ids == replies[0].token_ids


@pytest.mark.parametrize(
    ("family", "extra"),
    [("gemma3_text", ()), ("llama", ("--no-prompt-cache",))],
    ids=["sliding-window-caches", "turned-off"],
)
def test_no_reuse_where_caches_cannot_be_cut_back_or_when_off(
    tiny_model, cluster_pool, family, extra
):
    model = tiny_model(family, 4)
    running = cluster_pool.serving(model, 2, *extra, fresh=True)
    first = running.client.generate(_chat(FIRST))
    again = running.client.generate(_chat(FIRST))
    assert again.usage.cached_tokens == 0
    assert again.token_ids == first.token_ids
