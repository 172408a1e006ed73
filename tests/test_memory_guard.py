"""The memory guard: a cluster refuses to start when weights + the caches of --max-active
sequences of --max-context tokens do not fit a rank's limit, bounds each sequence by
--max-context, and admits at run time only what fits; no rank crashes from it.

Tiny models, and MLX_RELAY_MEMORY_LIMIT in megabytes, so that the caches of the model's
whole context (2,048 tokens) for 8 sequences do not fit while those of 128 tokens do.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import mlx.core as mx
import pytest
from conftest import assert_gone, start_cluster
from launching import MLX_RELAY
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from oracle import mlx_lm_tokens, tokenizer_for
from tiny_models import make_tiny_model

from mlx_relay.coordinator.requests import encode_text
from mlx_relay.launch.local import free_ports
from mlx_relay.model import memory, sharding
from mlx_relay.protocol import exits
from mlx_relay.protocol import relay_pb2 as pb

LIMIT = "4MB"  # tiny llama's rank 0: 0.56 MB of weights; caches of 8 x 2,048 tokens: 8.4 MB
MAX_CONTEXT = 128


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama-4"), "llama", num_layers=4)


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt_oss", "deepseek_v3"])
def test_cache_estimate_is_what_mlx_lm_allocates(family, tmp_path):
    """Plain KV caches, sliding windows (by pattern or layer_types) and MLA's latent
    caches, from the config alone, to the byte."""
    path = make_tiny_model(tmp_path / family, family, num_layers=4)
    net, _ = load(str(path))
    caches = make_prompt_cache(net)
    net(mx.array([list(range(5, 45))]), cache=caches)  # a 40-token prompt
    for _ in range(300):  # then decoding past the window and the first 256 positions
        net(mx.array([[7]]), cache=caches)
    mx.eval([c.state for c in caches])
    real = sum(c.keys.nbytes + c.values.nbytes for c in caches)
    assert memory.cache_nbytes(path, 0, 4, 340) == real
    # Split over ranks, the parts add up.
    assert memory.cache_nbytes(path, 0, 1, 340) + memory.cache_nbytes(path, 1, 4, 340) == real


def test_caches_of_another_kind_are_named_not_guessed(tmp_path):
    """qwen3_next keeps conv and gated-delta state (ArraysCache) on 2 of 3 layers; a
    DeepSeek-V3.2 config without its indexer's width says so instead of a KeyError."""
    path = make_tiny_model(tmp_path / "m", "qwen3_next", num_layers=3)
    with pytest.raises(memory.CacheUnknown, match="qwen3_next"):
        memory.cache_nbytes(path, 0, 3, 100)
    path = make_tiny_model(tmp_path / "v32", "deepseek_v32", num_layers=3)
    config = json.loads((path / "config.json").read_text())
    del config["index_head_dim"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(memory.CacheUnknown, match="index_head_dim"):
        memory.cache_nbytes(path, 0, 3, 100)


def _allocated(path: Path, tokens_after_prompt: int = 300) -> int:
    """Bytes mlx-lm's own caches hold after a 40-token prompt and this many decode steps:
    KV buffers whole (they grow by 256 positions), states as they are."""
    net, _ = load(str(path))
    caches = make_prompt_cache(net)
    net(mx.array([list(range(5, 45))]), cache=caches)
    for _ in range(tokens_after_prompt):
        net(mx.array([[7]]), cache=caches)
    total = 0
    for cache in sharding.flat_caches(caches):
        mx.eval(cache.state)
        if isinstance(getattr(cache, "keys", None), mx.array):
            total += cache.keys.nbytes + cache.values.nbytes
        else:
            total += sum(a.nbytes for _, a in tree_flatten(cache.state) if a is not None)
    return total


def test_caches_of_their_own_kind_are_measured_on_the_loaded_shard(tmp_path):
    """qwen3_next (conv and gated-delta state on 2 of 3 layers, KV on the third): what
    the config cannot tell is read off a probe step of the lazily loaded shard, to the
    byte of what mlx-lm holds; split over ranks, the parts add up."""
    path = make_tiny_model(tmp_path / "m", "qwen3_next", num_layers=3)
    real = _allocated(path)
    for start, end in [(0, 3), (0, 1), (1, 3)]:
        shard = sharding.load_shard(path, start, end, has_ends=start == 0)
        layout = memory.check_measured(path, start, end, shard, ends=start == 0)
        assert layout is not None
    assert memory.cache_nbytes(path, 0, 3, 340) == real
    assert memory.cache_nbytes(path, 0, 1, 340) + memory.cache_nbytes(path, 1, 3, 340) == real
    # A model the config tells about is not measured.
    plain = make_tiny_model(tmp_path / "llama", "llama", num_layers=2)
    shard = sharding.load_shard(plain, 0, 2, has_ends=True)
    assert memory.check_measured(plain, 0, 2, shard, ends=True) is None


def test_admission_takes_a_workers_measured_layout_for_its_model_only(tmp_path):
    """A worker sends the layout it measured in its stats; rank 0 counts it where the
    fingerprint and the layers are those of the model it serves."""
    path = make_tiny_model(tmp_path / "m", "qwen3_next", num_layers=3)
    layout = memory.measure_caches(sharding.load_shard(path, 1, 3, has_ends=False))
    mb = 1_000_000
    per_seq = memory.layout_nbytes(layout, 300)
    short = {"memory_limit": 100 * mb, "free_memory": 10**12}
    short["active_memory"] = 100 * mb - per_seq // 2 - int(0.025 * 100 * mb)
    fp = sharding.fingerprint(path)
    mine = {"fingerprint": fp, "layers": [1, 3], "layout": layout}
    figures = {1: {**short, "cache_layout": mine}}
    refused = memory.admission_shortfall(path, [(0, 1), (1, 3)], figures, 300, [], [], fp)
    assert refused.startswith("rank 1 has "), refused
    stale = {**mine, "fingerprint": "another model"}
    fresh = make_tiny_model(tmp_path / "n", "qwen3_next", num_layers=3, seed=1)
    figures = {1: {**short, "cache_layout": stale}}
    assert memory.admission_shortfall(fresh, [(0, 1), (1, 3)], figures, 300, [], [], fp) == ""


def test_admission_counts_growth_of_running_sequences_and_parked_caches(model):
    """What each rank has left (its stats), less what running sequences may still add,
    plus what parked prompt caches give back when their slot is taken."""
    ranges = [(0, 2), (2, 4)]
    per_seq = memory.cache_nbytes(model, 2, 4, 256)  # 256 positions on rank 1
    mb = 1_000_000
    roomy = {"memory_limit": 100 * mb, "active_memory": 10 * mb, "free_memory": 10**12}
    tight = {**roomy, "active_memory": 100 * mb - 3 * per_seq - int(0.025 * 100 * mb)}
    figures = {0: roomy, 1: tight}
    assert memory.admission_shortfall(model, ranges, figures, 200, [], []) == ""
    # Two running sequences that may each grow by 256 positions (10 -> 300 tokens: one
    # more step of 256) leave room for one more.
    assert memory.admission_shortfall(model, ranges, figures, 200, [(10, 300)] * 2, []) == ""
    short = memory.admission_shortfall(model, ranges, figures, 200, [(10, 300)] * 3, [])
    assert short.startswith("rank 1 has ") and "sequence of 200 tokens needs" in short
    # ... unless a parked cache gives its memory back.
    assert memory.admission_shortfall(model, ranges, figures, 200, [(10, 300)] * 3, [100]) == ""


def _local(model: Path, *args: str, limit: str = LIMIT) -> tuple[int, str, float]:
    """`mlx-relay local` that must end by itself: exit code, output, seconds."""
    address = f"127.0.0.1:{free_ports(1)[0]}"
    env = {**os.environ, memory.MEMORY_LIMIT_ENV: limit}
    t0 = time.monotonic()
    result = subprocess.run(
        [*MLX_RELAY, "local", "--model", str(model), "--grpc-address", address, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return result.returncode, result.stderr + result.stdout, time.monotonic() - t0


@pytest.mark.cluster
def test_a_cluster_whose_caches_do_not_fit_refuses_to_start_with_the_numbers(model):
    # Rank 0 (one layer) fits; rank 1 (three layers) holds three layers' caches: 12.6 MB.
    code, out, took = _local(model, "-n", "2", "--layers", "1,3", "--restarts", "2", limit="8MB")
    assert code == exits.EXIT_RANK_FAILED, out
    last = out.strip().splitlines()[-1]
    assert "rank 1" in last and "layers [1, 4) need" in last, last
    assert "of caches for --max-active 8 sequences of --max-context 2,048 tokens" in last, last
    assert "MLX_RELAY_MEMORY_LIMIT=8MB" in last and "lower --max-active or --max-context" in last
    assert "not restarted" in last, last  # it would fail the same way
    assert "Traceback" not in out
    # Rank 0 checks its own first, before any worker loads.
    code, out, _ = _local(model, "-n", "2")
    last = out.strip().splitlines()[-1]
    assert code == exits.EXIT_RANK_FAILED and "rank 0" in last, out
    assert "layers [0, 2) with embedding and head need" in last, last
    print(f"\nrefused in {took:.1f} s: {last}")


@pytest.mark.cluster
def test_a_hybrid_whose_measured_caches_do_not_fit_refuses_to_start(tmp_path):
    """qwen3_next's caches are measured once each rank has loaded its layers lazily (no
    weight read): rank 1's KV layer for 8 x 2,048 tokens (4.2 MB) does not fit 3 MB, and
    the cluster says so at start, with the numbers, as for a plain model."""
    path = make_tiny_model(tmp_path / "m", "qwen3_next", num_layers=3)
    code, out, _ = _local(path, "-n", "2", "--layers", "1,2", "--restarts", "2", limit="3MB")
    assert code == exits.EXIT_RANK_FAILED, out
    last = out.strip().splitlines()[-1]
    assert "rank 1" in last and "layers [1, 3) need" in last, last
    assert "MB of caches for --max-active 8 sequences of --max-context 2,048" in last, last
    assert "Traceback" not in out


@pytest.fixture(scope="module")
def tight(model, tmp_path_factory):
    """Two ranks at LIMIT each: fits with --max-context 128."""
    running = start_cluster(
        model,
        2,
        tmp_path_factory.mktemp("tight"),
        "--max-context",
        str(MAX_CONTEXT),
        env={memory.MEMORY_LIMIT_ENV: LIMIT},
        timeout=120,
    )
    yield running
    pids = running.pids
    running.stop()
    assert_gone(pids)


def _prompt(model: Path, n: int) -> tuple[str, list[int]]:
    """A prompt of exactly `n` tokens (one per 'x' with the tiny tokenizer)."""
    text = "x" * n
    tokens = encode_text(tokenizer_for(model), text)
    assert len(tokens) == n
    return text, tokens


@pytest.mark.cluster
def test_max_context_bounds_prompt_plus_output(model, tight):
    client = tight.client

    # A prompt that leaves no room for one token under the bound is refused.
    request = pb.GenerateRequest(
        prompt=_prompt(model, MAX_CONTEXT)[0], params=pb.SamplingParams(ignore_eos=True)
    )
    with pytest.raises(grpc.RpcError) as info:
        client.generate(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert "--max-context" in info.value.details()
    # max_tokens is a ceiling (api/budget.py): set beyond the bound or unset (the default
    # 256), the answer ends at the bound.
    text, tokens = _prompt(model, 100)
    for max_tokens in (29, None):
        params = pb.SamplingParams(ignore_eos=True)
        if max_tokens is not None:
            params.max_tokens = max_tokens
        filled = client.generate(pb.GenerateRequest(prompt=text, params=params))
        assert len(filled.token_ids) == MAX_CONTEXT - 100 and filled.finish_reason == "length"
    # Right at the bound: served, token-exact.
    exact = client.generate(
        pb.GenerateRequest(prompt=text, params=pb.SamplingParams(max_tokens=28, ignore_eos=True))
    )
    assert list(exact.token_ids) == mlx_lm_tokens(model, tokens, 28)


@pytest.mark.cluster
def test_a_flood_of_longest_sequences_under_the_limit_crashes_no_rank(model, tight):
    """24 concurrent sequences of --max-context tokens for 8 slots: each finishes or is
    refused with RESOURCE_EXHAUSTED, and every rank is still there."""
    client = tight.client
    text, tokens = _prompt(model, 60)
    request = pb.GenerateRequest(
        prompt=text, params=pb.SamplingParams(max_tokens=68, ignore_eos=True)
    )
    expected = mlx_lm_tokens(model, tokens, 68)

    def one(_: int) -> str:
        try:
            response = client.generate(request)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
            return "exhausted"
        assert list(response.token_ids) == expected
        return "ok"

    with ThreadPoolExecutor(24) as pool:
        outcomes = list(pool.map(one, range(24)))
    assert outcomes.count("ok") >= 8, outcomes
    assert all(p.poll() is None for p in tight.cluster.procs)
    assert client.status().state == "serving"
    print(f"\n24 longest sequences at {LIMIT} per rank: {outcomes.count('ok')} served")
