"""The correctness oracle: single-process mlx-lm on the same model and prompt."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from functools import lru_cache
from pathlib import Path

import mlx.core as mx
from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from mlx_relay.protocol import relay_pb2 as pb

# The question the tests of the default model ask it (greedy, at most 24 tokens: its
# answer names Paris in 7), the same everywhere so that mlx-lm answers it once.
PARIS_QUESTION = "What is the capital of France? Answer in one sentence."
PARIS_TOKENS = 24

# A directory the test session's processes share (conftest.py sets it): mlx-lm's tokens
# for one model, prompt and settings are computed once, not once per test file or worker
# (the default model takes ~0.14 s a token on the 2-core machine, prompt tokens included).
CACHE_ENV = "MLX_RELAY_TEST_ORACLE_CACHE"


def _model_key(path: Path) -> list:
    """A model by its directory and its weight files' sizes and times (tiny models of
    different seeds share their config and sizes, never their directory)."""
    path = Path(path).resolve()
    files = sorted(path.glob("*.safetensors"))
    return [str(path)] + [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def _cache_file(path: Path, prompt_tokens: list[int], settings: dict) -> Path | None:
    """Where this call's answer is kept, keyed by everything but max_tokens (a greedy or
    seeded answer for N tokens is the first N of a longer one); None without a cache."""
    root = os.environ.get(CACHE_ENV)
    if not root:
        return None
    key = json.dumps([_model_key(path), prompt_tokens, settings], sort_keys=True)
    return Path(root) / f"{hashlib.sha256(key.encode()).hexdigest()}.json"


def _cached(file: Path | None, max_tokens: int) -> list[int] | None:
    """The first `max_tokens` of a kept answer computed for at least as many."""
    try:
        kept = json.loads(file.read_text()) if file else None
    except (OSError, ValueError):
        return None
    if kept is None or kept["max_tokens"] < max_tokens:
        return None
    return kept["tokens"][:max_tokens]


def _keep(file: Path | None, max_tokens: int, tokens: list[int]) -> None:
    if file is None:
        return
    file.parent.mkdir(parents=True, exist_ok=True)
    part = file.with_suffix(f".{os.getpid()}.{threading.get_ident()}")
    part.write_text(json.dumps({"max_tokens": max_tokens, "tokens": tokens}))
    os.replace(part, file)  # (whole or not at all, for a process reading it meanwhile)


@lru_cache(maxsize=8)
def _load(path: str):
    return load(path)


def tokenizer_for(path: Path):
    return _load(str(path))[1]


def chat_tokens(path: Path, messages: list[dict], **template_kwargs) -> list[int]:
    """How mlx-lm renders a chat: the tokenizer's template to text, then the text encoded
    as mlx-lm's `stream_generate` encodes a string prompt (special tokens added unless the
    text already starts with BOS). Written here from mlx-lm's and the tokenizer's own
    calls, never the product's, so a change of the product's encoding is caught."""
    tokenizer = tokenizer_for(path)
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **template_kwargs
    )
    bos = tokenizer.bos_token
    return list(tokenizer.encode(text, add_special_tokens=bos is None or not text.startswith(bos)))


def raw_prompt_tokens(path_or_tokenizer, text: str) -> list[int]:
    """A raw (untemplated) prompt's tokens as mlx-lm's `stream_generate` encodes a string
    prompt: the tokenizer's own `encode`, special tokens (BOS) added unless the text
    already starts with BOS, the rule the server keeps for a raw prompt. Written here from
    the tokenizer's own calls, never the product's `encode_text`, so a change of the
    product's encoding is caught. `path_or_tokenizer`: a model directory or its tokenizer."""
    tokenizer = (
        tokenizer_for(path_or_tokenizer)
        if isinstance(path_or_tokenizer, (str, Path))
        else path_or_tokenizer
    )
    bos = tokenizer.bos_token
    return list(tokenizer.encode(text, add_special_tokens=bos is None or not text.startswith(bos)))


def _processors(settings: dict, n_prompt: int, max_tokens: int) -> list:
    """mlx-lm's processors, with presence and frequency penalties counting generated
    tokens only (OpenAI's definition) by hiding the prompt from them."""
    settings = dict(settings)
    openai = {
        name: settings.pop(name)
        for name in ("presence_penalty", "frequency_penalty")
        if name in settings
    }
    processors = make_logits_processors(**settings)
    if openai:
        windows = {n.replace("penalty", "context_size"): max_tokens for n in openai}
        for processor in make_logits_processors(**openai, **windows):
            processors.append(
                lambda tokens, logits, p=processor: (
                    p(tokens[n_prompt:], logits) if len(tokens) > n_prompt else logits
                )
            )
    return processors


def mlx_lm_tokens(
    path: Path,
    prompt_tokens: list[int],
    max_tokens: int,
    *,
    seed: int | None = None,
    sampler: dict | None = None,
    processors: dict | None = None,
    prefill_step_size: int = 2048,
    draft: Path | None = None,
    num_draft_tokens: int = 2,
) -> list[int]:
    """Tokens `mlx_lm.stream_generate` produces (the EOS token itself not included);
    with `draft`, its speculative generator's with that draft model (its own prefill
    step, 512, as mlx_relay's draft prefill)."""
    settings = {
        "seed": seed,
        "sampler": sampler,
        "processors": processors,
        "prefill_step_size": prefill_step_size,
        # (a speculative run's last round depends on max_tokens: kept per max_tokens)
        "draft": [_model_key(draft), num_draft_tokens, max_tokens] if draft else None,
    }
    file = _cache_file(path, prompt_tokens, settings)
    if (tokens := _cached(file, max_tokens)) is not None:
        return tokens
    tokens = _generate(
        path, prompt_tokens, max_tokens, seed, sampler, processors, prefill_step_size,
        draft, num_draft_tokens,
    )  # fmt: skip
    _keep(file, max_tokens, tokens)
    return tokens


def _generate(
    path: Path,
    prompt_tokens: list[int],
    max_tokens: int,
    seed: int | None,
    sampler: dict | None,
    processors: dict | None,
    prefill_step_size: int,
    draft: Path | None,
    num_draft_tokens: int,
) -> list[int]:
    model, tokenizer = _load(str(path))
    if seed is not None:
        mx.random.seed(seed)
    options = (
        {"draft_model": _load(str(draft))[0], "num_draft_tokens": num_draft_tokens}
        if draft is not None
        else {"prefill_step_size": prefill_step_size}
    )
    responses = list(
        stream_generate(
            model,
            tokenizer,
            mx.array(prompt_tokens),
            max_tokens=max_tokens,
            sampler=make_sampler(**(sampler or {})),
            logits_processors=_processors(processors or {}, len(prompt_tokens), max_tokens),
            **options,
        )
    )
    tokens = [r.token for r in responses]
    if responses and responses[-1].finish_reason == "stop":
        tokens = tokens[:-1]
    return tokens


def chat_request(text: str, seed: int | None, max_tokens: int) -> pb.GenerateRequest:
    """A one-message chat: greedy, or with `seed` sampled at temperature 0.9, top-p 0.95
    (mlx_lm_tokens' sampler={"temp": 0.9, "top_p": 0.95} is the same)."""
    params = pb.SamplingParams(max_tokens=max_tokens)
    if seed is not None:
        params.temperature, params.top_p, params.seed = 0.9, 0.95, seed
    return pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=text)], params=params)


def generate_concurrently(client, requests: list[pb.GenerateRequest]) -> list[object]:
    """Each request's token ids (or the exception it raised), all sent at once, so the
    cluster decodes them in one group."""
    results: list[object] = [None] * len(requests)

    def run(i: int) -> None:
        try:
            results[i] = list(client.generate(requests[i]).token_ids)
        except Exception as e:  # noqa: BLE001 - reported by the caller's assert
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return results


def mlx_lm_continue(path: Path, cache: list, prompt: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's greedy tokens (EOS dropped) for `prompt`, continuing the prompt cache
    `cache` (what a second request reusing a first one's caches must give)."""
    model, tokenizer = _load(str(path))
    tokens = []
    for r in stream_generate(
        model, tokenizer, mx.array(prompt), max_tokens=max_tokens, prompt_cache=cache
    ):
        if r.finish_reason == "stop":
            break
        tokens.append(r.token)
    return tokens
