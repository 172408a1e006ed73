"""Checks the family test files share: the uneven splits, the chat requests and their
mlx-lm answers, and a second request's prefix reuse checked against mlx-lm's own prompt
cache (exact where the caches can be cut back, mlx-lm's tokens either way)."""

from __future__ import annotations

import functools

from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from oracle import (
    _load,
    chat_request,
    chat_tokens,
    mlx_lm_continue,
    mlx_lm_tokens,
    raw_prompt_tokens,
    tokenizer_for,
)

from mlx_relay.model import sharding
from mlx_relay.protocol import relay_pb2 as pb

# Uneven splits of 6 layers; each puts a rank boundary between layers of different kinds
# somewhere (qwen3_next: linear 0,1 | full 2 | linear 3,4, full 5; gpt_oss: sliding on
# even layers).
SPLITS = ([(0, 6)], [(0, 2), (2, 6)], [(0, 1), (1, 4), (4, 6)], [(0, 2), (2, 3), (3, 6)])
MAX_TOKENS = 10
RAW_TOKENS = 4


def whole_model(model_dir):
    """The whole mlx-lm model at `model_dir` (loaded once, shared with the oracle)."""
    return _load(str(model_dir))[0]


def family_request(text: str, seed: int | None) -> pb.GenerateRequest:
    """A one-message chat of `text`, greedy or seeded, for MAX_TOKENS tokens."""
    return chat_request(text, seed, MAX_TOKENS)


@functools.cache
def family_oracle(path, text: str, seed: int | None) -> list[int]:
    """mlx-lm's tokens for `family_request(text, seed)`, once per model and request
    (multiplier families ask at 3 rank counts)."""
    prompt = chat_tokens(path, [{"role": "user", "content": text}])
    if seed is None:
        return mlx_lm_tokens(path, prompt, MAX_TOKENS)
    return mlx_lm_tokens(path, prompt, MAX_TOKENS, seed=seed, sampler={"temp": 0.9, "top_p": 0.95})


def raw_request(text: str, max_tokens: int = MAX_TOKENS) -> pb.GenerateRequest:
    """A raw (untemplated) prompt, greedy."""
    return pb.GenerateRequest(prompt=text, params=pb.SamplingParams(max_tokens=max_tokens))


def streamed_text(tokenizer, tokens: list[int]) -> str:
    """The text a stream of `tokens` shows (the streaming detokenizer, as the server)."""
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for t in tokens:
        detokenizer.add_token(t)
    detokenizer.finalize()
    return detokenizer.text


def continuable_prompt(path) -> str:
    """A raw prompt whose greedy output, as text, encodes back to the same tokens after
    it (a random model's output often splits UTF-8 characters), so that a prompt going
    on from prompt + output shares everything the first request's caches hold."""
    tokenizer = tokenizer_for(path)
    for i in range(40):
        raw = f"Item {i}: pipelines split a model's layers across machines.\n"
        prompt = raw_prompt_tokens(tokenizer, raw)
        out = mlx_lm_tokens(path, prompt, RAW_TOKENS)
        again = raw_prompt_tokens(tokenizer, raw + streamed_text(tokenizer, out) + "\nAnd then?")
        if again[: len(prompt) + len(out)] == prompt + out:
            return raw
    raise AssertionError("no prompt among 40 whose output re-encodes as itself")


def cache_position(cache: list) -> int:
    """How many tokens a prompt cache holds (its first cache with an offset)."""
    return next(c.offset for c in sharding.flat_caches(cache) if hasattr(c, "offset"))


def second_equals_mlx_lm(running, path, first: list[int], second: list[dict] | str) -> int:
    """Send `second` (chat messages or a raw prompt) after `first` ran; check the reuse
    and the tokens against mlx-lm; return how many prompt tokens were reused."""
    if isinstance(second, str):
        response = running.client.generate(raw_request(second))
        tokens = raw_prompt_tokens(path, second)
    else:
        messages = [pb.ChatMessage(**m) for m in second]
        params = pb.SamplingParams(max_tokens=MAX_TOKENS)
        response = running.client.generate(pb.GenerateRequest(messages=messages, params=params))
        tokens = chat_tokens(path, second)
    cached = response.usage.cached_tokens
    model = whole_model(path)
    cache = make_prompt_cache(model)
    if cached:
        mlx_lm_continue(path, cache, first, MAX_TOKENS if isinstance(second, list) else RAW_TOKENS)
        held = cache_position(cache)
        shard_rule = sharding.reuse_rule(cache)
        assert cached == held or held < shard_rule[1], f"reused {cached} of {held}: not exact"
        assert trim_prompt_cache(cache, held - cached) == held - cached
        expected = mlx_lm_continue(path, cache, tokens[cached:], MAX_TOKENS)
    else:
        expected = mlx_lm_tokens(path, tokens, MAX_TOKENS)
    assert list(response.token_ids) == expected
    return cached
