"""Per-request sampling reproduces mlx-lm's global-RNG sampler exactly."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler

from mlx_relay.coordinator.sampling import Sampler, SamplingParams

SETTINGS = [
    {"temp": 0.8},
    {"temp": 0.7, "top_p": 0.9},
    {"temp": 1.0, "top_k": 5},
    {"temp": 0.9, "min_p": 0.1},
    {"temp": 0.8, "xtc_probability": 0.5, "xtc_threshold": 0.05},
    {"temp": 0.6, "top_p": 0.8, "min_p": 0.05, "top_k": 20, "xtc_probability": 0.3},
]


def _params(kw, seed):
    return SamplingParams(
        temperature=kw["temp"],
        top_p=kw.get("top_p", 0.0),
        top_k=kw.get("top_k", 0),
        min_p=kw.get("min_p", 0.0),
        xtc_probability=kw.get("xtc_probability", 0.0),
        xtc_threshold=kw.get("xtc_threshold", 0.1),
        seed=seed,
    )


@pytest.mark.parametrize("kw", SETTINGS, ids=str)
def test_same_draws_as_mlx_lm(kw):
    logits = mx.random.normal((1, 200), key=mx.random.key(1)) * 3
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    mx.random.seed(42)
    reference = make_sampler(**kw)
    expected = [reference(logprobs).item() for _ in range(40)]
    mine = Sampler(_params(kw, 42))
    assert [mine.sample(logprobs).item() for _ in range(40)] == expected


def test_interleaved_requests_do_not_disturb_each_other():
    logits = mx.random.normal((1, 100), key=mx.random.key(3))
    a, b = Sampler(_params({"temp": 1.0}, 1)), Sampler(_params({"temp": 1.0}, 2))
    alone = Sampler(_params({"temp": 1.0}, 1))
    expected = [alone.sample(logits).item() for _ in range(20)]
    got = []
    for _ in range(20):
        got.append(a.sample(logits).item())
        b.sample(logits)
        mx.random.uniform()  # global state traffic must not matter either
    assert got == expected


def test_presence_and_frequency_penalties_count_generated_tokens_as_openai_documents():
    """OpenAI: logit[j] -= c[j] * frequency + (c[j] > 0) * presence, where c[j] counts
    how often j was sampled so far. The prompt does not count, and there is no window."""
    vocab = 50
    logits = mx.random.normal((1, vocab), key=mx.random.key(3))
    prompt = [1, 2, 3, 4]
    generated = [5, 6, 5, 7, 5] + [8] * 30  # token 5's repeats lie beyond any 20-token window
    sampler = Sampler(SamplingParams(max_tokens=64, presence_penalty=0.5, frequency_penalty=0.3))
    got = np.array(sampler.process(prompt + generated, generated, mx.array(logits)))
    counts = np.bincount(generated, minlength=vocab)
    expected = np.array(logits) - counts * 0.3 - (counts > 0) * 0.5
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    # Nothing generated yet: the prompt alone changes nothing.
    first = np.array(sampler.process(prompt, [], mx.array(logits)))
    np.testing.assert_array_equal(first, np.array(logits))
