"""Quantized KV caches (--kv-bits, --kv-group-size, --quantized-kv-start), as mlx-lm's.

The oracle is single-process mlx-lm with the same settings: it prefills all prompt
tokens but the last, quantizes every plain KV cache that holds --quantized-kv-start
positions after each step, and decodes each sequence alone. In process, the stages
give its logits bit for bit (a decode group runs row by row on its quantized caches);
through real clusters, concurrent greedy and seeded streams give its tokens at 1-3
uneven ranks, every rank quantizing as rank 0's load document says.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import pytest
from conftest import start_cluster, stop_cluster
from mlx_lm.generate import maybe_quantize_kv_cache, stream_generate
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from oracle import _load, chat_request, chat_tokens, generate_concurrently
from staged import Staged

from mlx_relay.model import memory, sharding
from mlx_relay.protocol import relay_pb2 as pb

BITS, GROUP = 4, 32
KV = {"bits": BITS, "group_size": GROUP, "start": 0}
HIDDEN = 128  # head dim 32: a multiple of the group size
NUM_LAYERS = 6
MAX_TOKENS = 10
PROMPTS = [
    ("Tell me about the sea.", None),
    ("Hello! What is the weather like in Paris today, and tomorrow?", 7),
    ("Write add(a, b) in Python.", None),
]


@functools.cache
def _oracle(path, text: str, seed: int | None, kv_bits: int | None = BITS) -> list[int]:
    """mlx-lm's tokens with the same KV quantization (kv_bits None: plain caches), once
    per model and request (the cluster test asks at 3 rank counts)."""
    model, tokenizer = _load(str(path))
    prompt = chat_tokens(path, [{"role": "user", "content": text}])
    sampler = make_sampler(0.9, 0.95) if seed is not None else make_sampler()
    if seed is not None:
        mx.random.seed(seed)
    out = stream_generate(
        model,
        tokenizer,
        mx.array(prompt),
        max_tokens=MAX_TOKENS,
        sampler=sampler,
        kv_bits=kv_bits,
        kv_group_size=GROUP,
        quantized_kv_start=0,
    )
    responses = list(out)
    tokens = [r.token for r in responses]
    return tokens[:-1] if responses and responses[-1].finish_reason == "stop" else tokens


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_stages_equal_mlx_lm_with_quantized_caches(tiny_model, family):
    """Two sequences prefilled alone then decoded as one group, over uneven stages:
    each row's logits are bit-identical to mlx-lm's quantized single-sequence run."""
    path = tiny_model(family, NUM_LAYERS, hidden_size=HIDDEN)
    model = _load(str(path))[0]
    staged = Staged(path, [(0, 2), (2, 6)], kv=KV)  # (rank 0's runner, the worker's take)
    assert not staged.shards[0].reusable_caches  # a quantized prefix is not reused
    prompts = {
        0: [(7 * i + 11) % 500 + 7 for i in range(12)],
        1: [(5 * i) % 500 + 9 for i in range(20)],
    }
    feed = [9, 99, 199, 299, 13]

    expected, got = {}, {s: [] for s in prompts}
    for s, prompt in prompts.items():
        cache = make_prompt_cache(model)
        model(mx.array([prompt[:-1]]), cache=cache)
        out = []
        for t in [prompt[-1], *feed]:
            maybe_quantize_kv_cache(cache, 0, GROUP, BITS)
            out.append(model(mx.array([[t]]), cache=cache)[:, -1])
        expected[s] = out
        n = len(prompt)
        staged.step([s], [0], mx.array([prompt[:-1]]))
        got[s].append(staged.step([s], [n - 1], mx.array([prompt[-1:]])))
    for i, _ in enumerate(feed):
        offsets = [len(prompts[s]) + i for s in prompts]
        logits = staged.step([0, 1], offsets, mx.array([[feed[i]]] * 2), group=1)
        for row, s in enumerate(prompts):
            got[s].append(logits[row : row + 1])
    for s in prompts:
        for i, (a, b) in enumerate(zip(got[s], expected[s], strict=True)):
            assert mx.array_equal(a, b).item(), f"{family}: slot {s} step {i} differs"
    quantized = [c for c in staged.workers[0].caches.single[0] if isinstance(c, QuantizedKVCache)]
    assert quantized and all(c.bits == BITS and c.group_size == GROUP for c in quantized)


def test_caches_that_cannot_be_quantized_are_refused_at_load(tiny_model):
    """Sliding windows (mlx-lm cannot quantize them either), and MLA's rotary key of 8
    values (not a multiple of the group size): refused when the shard loads, on every
    rank (a worker's shard too), never at generation time."""
    path = tiny_model("gpt_oss", 4)
    with pytest.raises(sharding.UnsupportedFamily, match="'gpt_oss'.*--kv-bits.*sliding-window"):
        sharding.load_shard(path, 0, 2, has_ends=True, kv=KV)
    path = tiny_model("deepseek_v3", 4, hidden_size=HIDDEN)
    for start, end, ends in ((0, 2, True), (2, 4, False)):
        with pytest.raises(
            sharding.UnsupportedFamily,
            match="'deepseek_v3': its caches cannot be quantized with --kv-bits 4 "
            "--kv-group-size 32: .*divisible by the quantization group size",
        ):
            sharding.load_shard(path, start, end, has_ends=ends, kv=KV)
    with pytest.raises(ValueError, match="--kv-bits must be"):
        sharding.KVQuant(bits=7)


def test_the_memory_estimate_counts_quantized_caches(tiny_model):
    """The estimate equals the bytes mlx-lm's quantized caches really take."""
    path = tiny_model("llama", NUM_LAYERS, hidden_size=HIDDEN)
    model = _load(str(path))[0]
    cache = make_prompt_cache(model)
    model(mx.array([[(3 * i) % 500 + 7 for i in range(999)]]), cache=cache)
    maybe_quantize_kv_cache(cache, 0, GROUP, BITS)
    model(mx.array([[9]]), cache=cache)
    real = sum(c.nbytes for c in cache)
    saved = memory.plan()
    try:
        plain = memory.cache_nbytes(path, 0, NUM_LAYERS, 1000)
        memory.configure(memory.Plan(8, 0, BITS, GROUP, 0))
        quantized = memory.cache_nbytes(path, 0, NUM_LAYERS, 1000)
    finally:
        memory.configure(saved)
    # Per position and layer: 2 x 2 KV heads x head dim 32 = 128 float32 values, 512
    # bytes; quantized: 128 x 4 bits = 64 bytes + a float32 scale and bias per 32 values.
    assert quantized * 512 == plain * (64 + 2 * 4 * 128 // GROUP)
    assert quantized == real


def _request(text: str, seed: int | None) -> pb.GenerateRequest:
    return chat_request(text, seed, MAX_TOKENS)


@pytest.mark.cluster
@pytest.mark.parametrize(("ranks", "layers"), [(1, None), (2, "2,4"), (3, "1,3,2")])
def test_clusters_with_kv_bits_equal_mlx_lm(tiny_model, tmp_path, ranks, layers):
    path = tiny_model("llama", NUM_LAYERS, hidden_size=HIDDEN)
    expected = [_oracle(path, text, seed) for text, seed in PROMPTS]
    plain = [_oracle(path, text, seed, kv_bits=None) for text, seed in PROMPTS]
    assert expected != plain, "4-bit caches change some tokens (else this test proves nothing)"
    flags = ["--kv-bits", str(BITS), "--kv-group-size", str(GROUP), "--quantized-kv-start", "0"]
    running = start_cluster(path, ranks, tmp_path / "logs", *flags, layers=layers)
    try:
        got = generate_concurrently(running.client, [_request(*p) for p in PROMPTS])
        for i, (tokens, want) in enumerate(zip(got, expected, strict=True)):
            assert tokens == want, f"request {i} at {ranks} ranks"
        status = running.client.status()
        assert status.active_requests == 0 and status.queued_requests == 0
        if ranks == 2:  # a stream cancelled mid-decode leaves the others exact
            cancelled = running.client.stream(_request(*PROMPTS[0]))
            kept = running.client.stream(_request(*PROMPTS[1]))
            next(iter(cancelled))
            cancelled.cancel()
            assert [t for chunk in kept for t in chunk.token_ids] == expected[1]
            again = running.client.generate(_request(*PROMPTS[2]))
            assert list(again.token_ids) == expected[2]
    finally:
        stop_cluster(running)
