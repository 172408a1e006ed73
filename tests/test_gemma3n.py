"""gemma3n (its text model) split across ranks: AltUp streams, per-layer inputs, KV sharing.

gemma3n's hidden state between layers is `altup_num_inputs` streams, made from the
embedding before the first layer and merged back before the final norm; they travel
between ranks folded into the payload's width (model/altup.py). Its layers also take
per-layer inputs, which rank 0 alone computes and sends as a side array, and its last
layers reuse earlier layers' keys and values, so the last rank holds them together
(both as for gemma4's 2B/4B layouts: tests/test_gemma4_small.py). Checked on a tiny
random gemma3n (Laurel blocks, activation sparsity on its first layers, sliding and full
attention) against single-process mlx-lm: logits bit-identical at 1, 2 and 3 uneven
stages over a prefill that passes the sliding window and decode steps, and a 3-rank
cluster's concurrent greedy and seeded streams token-exact.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from family_checks import (
    RAW_TOKENS,
    continuable_prompt,
    family_oracle,
    family_request,
    raw_request,
    second_equals_mlx_lm,
)
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model
from oracle import generate_concurrently, raw_prompt_tokens
from staged import Staged, greedy_forward
from tiny_models import GEMMA3N_KV_SHARED, GEMMA3N_PER_LAYER_VOCAB

from mlx_relay.model import checkpoint, sharding
from mlx_relay.model.split import default_split, keep_kv_shared_together, model_layers
from mlx_relay.model.step_inputs import LayerInputs

NUM_LAYERS = 6
HIDDEN = 64
STREAMS = 4  # the tiny model's altup_num_inputs
# Layers 4 (sliding) and 5 (full) reuse layers 3 and 2: the last rank holds [2, 6).
TAIL = 4
SPLITS = ([(0, 6)], [(0, 2), (2, 6)], [(0, 1), (1, 2), (2, 6)])
ROOT_PARTS = (
    "embed_tokens_per_layer",
    "per_layer_model_projection",
    "per_layer_projection_norm",
    "altup_projections",
    "altup_unembed_projections",
)
PROMPTS = [("Tell me about the sea.", None), ("Write add(a, b) in Python.", 21)]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("gemma3n", NUM_LAYERS)


@pytest.mark.parametrize("dtype", [None, mx.bfloat16], ids=["float32", "bfloat16"])
def test_stages_equal_the_whole_model(model, dtype):
    """Logits bit-identical to mlx-lm's for a 40-token prefill (ids past the per-layer
    table's too) and 10 decode steps, at 1, 2 and 3 uneven stages, in the checkpoint's
    float32 and in bfloat16 (the released models' dtype)."""
    whole = load_model(model)[0]  # (its own: the oracle's cached one stays float32)
    if dtype is not None:
        whole.set_dtype(dtype)
    prompt = mx.array([[(7 * i + 11) % 500 + 7 for i in range(40)]])
    assert (prompt >= GEMMA3N_PER_LAYER_VOCAB).any().item()
    steps = [mx.array([[t]]) for t in (9, 99, 199, 299, 399, 13, 31, 71, 171, 271)]
    cache = make_prompt_cache(whole)
    expected = [whole(prompt, cache=cache)[:, -1]] + [whole(t, cache=cache)[:, -1] for t in steps]
    for split in SPLITS:
        staged = Staged(model, split, dtype)
        shards = staged.shards
        assert all(s.takes_inputs for s in shards)
        assert len(shards[-1].make_caches()) == split[-1][1] - split[-1][0] - GEMMA3N_KV_SHARED
        forward = greedy_forward(staged)
        got = [forward(prompt)]
        # (the payload between ranks: the AltUp streams folded into its width)
        on, back = (1, 40, STREAMS * HIDDEN), (1, 1, STREAMS * HIDDEN)
        assert [h.payload_shape for h in staged.hops] == [on] * (len(split) - 1) + [back] * (
            len(split) > 1
        )
        got += [forward(t) for t in steps]
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert mx.array_equal(a, b).item(), f"split {split}: step {i} differs"


def test_every_stream_matters(model):
    """The check above can fail: a hop that carried only the first AltUp stream (the
    others zeroed) would change the logits."""
    prompt = mx.array([[(7 * i + 11) % 500 + 7 for i in range(40)]])
    shards = [sharding.load_shard(model, a, b, has_ends=a == 0) for a, b in SPLITS[1]]
    h = sharding.embed(shards[0], prompt)
    per_layer = sharding.per_layer_inputs(shards[0], prompt, h)
    inputs = LayerInputs(offsets=[0], deltas=[0], per_layer=per_layer)
    first = sharding.run_layers(shards[0], h, shards[0].make_caches(), inputs)
    outs = []
    for hop in (
        first,
        mx.concatenate([first[..., :HIDDEN], mx.zeros_like(first[..., HIDDEN:])], -1),
    ):
        inputs = LayerInputs(offsets=[0], deltas=[0], per_layer=per_layer[:, :, 2:])
        last = sharding.run_layers(shards[1], hop, shards[1].make_caches(), inputs)
        outs.append(sharding.head(shards[0], last)[:, -1])
    assert mx.isfinite(outs[1]).all().item()
    assert not mx.allclose(outs[0], outs[1]).item()


def test_only_rank_0_holds_the_per_layer_table_and_altup_projections(model):
    """Workers drop the per-layer table and projection and the AltUp projections before
    any weight is read; the memory check and the split count them as rank 0's."""
    worker = sharding.load_shard(model, 2, NUM_LAYERS, has_ends=False)
    assert not any(name in worker.inner for name in ROOT_PARTS)
    assert "embed_tokens" not in worker.inner
    first = sharding.load_shard(model, 0, 2, has_ends=True)
    assert all(first.inner[name] is not None for name in ROOT_PARTS)
    assert sharding.computes_per_layer_inputs(first)
    names = checkpoint.tensor_bytes(model)
    rank_0s = [n for n in names if any(p in n for p in ROOT_PARTS)]
    assert len(rank_0s) == 3 + 2 * (STREAMS - 1)
    assert all(checkpoint.layer_of(n) is None for n in rank_0s)
    assert {checkpoint.layer_of(n) for n in names} == {None, *range(NUM_LAYERS)}


def test_kv_shared_layers_stay_with_the_layers_they_reuse(model):
    """As gemma4's: a rank holding a KV-shared layer without the layer it reuses is
    refused at load, naming both; the default split gives the last rank those layers,
    counts a user gives that part them are refused before any rank loads."""
    assert sharding.kv_shared_tail(sharding.read_config(model)) == TAIL
    with pytest.raises(sharding.UnsupportedFamily, match="layer 5 reuses layer 2's keys"):
        sharding.load_shard(model, 3, NUM_LAYERS, has_ends=False)
    assert default_split(model, NUM_LAYERS, 3) == [1, 1, 4]
    assert keep_kv_shared_together(model, [2, 2, 2], computed=True) == [1, 1, 4]
    with pytest.raises(ValueError, match="the last rank must hold at least 4 layers"):
        model_layers("3,3", str(model), 2)


@pytest.mark.cluster
def test_cluster_equals_mlx_lm(model, cluster_pool):
    """Three uneven ranks on the default split, whose last rank holds the KV-shared
    layers: concurrent greedy and seeded streams (one decode group) equal
    mlx-lm's, and so does a raw prompt continuing an earlier one and its output, which
    starts from that one's caches (the layers' position offset comes from them)."""
    running = cluster_pool.serving(model, 3)
    ranks = sorted(running.client.status().ranks, key=lambda r: r.rank)
    assert ranks[-1].layer_start <= NUM_LAYERS - TAIL, ranks
    results = generate_concurrently(running.client, [family_request(*p) for p in PROMPTS])
    for i, (text, seed) in enumerate(PROMPTS):
        assert results[i] == family_oracle(model, text, seed), f"request {i} ({seed=})"
    raw = continuable_prompt(model)
    raw_reply = running.client.generate(raw_request(raw, RAW_TOKENS)).text
    first = raw_prompt_tokens(model, raw)
    cached = second_equals_mlx_lm(running, model, first, raw + raw_reply + "\nAnd then?")
    assert cached > len(first), "continuing a prompt and its output reuses its caches"
