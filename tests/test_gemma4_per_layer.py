"""gemma4_text with per-layer inputs (the 2B/4B layouts' `hidden_size_per_layer_input`).

Each layer of these models takes, besides the hidden state, its slice of a per-layer
input that the model computes before its first layer from the token ids (a per-layer
embedding table, most of the real models' weights) and the first hidden state. Rank 0
alone holds that table and computes them every step; they travel as a side array after
the hidden state, and each rank keeps its own layers' slices and passes the rest on
(step_inputs.pass_on). Checked on a tiny random gemma4_text (KV sharing off: still
refused) against single-process mlx-lm: logits bit-identical at 1, 2 and 3 uneven
stages, and a 3-rank cluster's concurrent greedy and seeded streams token-exact.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from oracle import generate_concurrently
from test_families import SPLITS, _oracle, _request, _whole
from tiny_models import VOCAB_SIZE

from mlx_relay.model import checkpoint, sharding
from mlx_relay.model.kvcache import SlotCaches
from mlx_relay.model.stage import forward_stage
from mlx_relay.model.step_inputs import pass_on
from mlx_relay.protocol import header as hdr

NUM_LAYERS = 6
PER_LAYER = (("hidden_size_per_layer_input", 8), ("vocab_size_per_layer_input", VOCAB_SIZE))
ROOT_PARTS = ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm")
PROMPTS = [("Tell me about the sea.", None), ("Write add(a, b) in Python.", 21)]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("gemma4_text", NUM_LAYERS, overrides=PER_LAYER)


def _staged(shards: list[sharding.Shard], caches: list[SlotCaches]):
    """One sequence's forward through the stages as the ranks run it: rank 0 embeds and
    computes every layer's per-layer input, each stage takes a step's header (through
    the wire format) and what the rank before passed on, and passes on the rest."""
    position = 0

    def forward(tokens: mx.array) -> mx.array:
        nonlocal position
        n = tokens.shape[1]
        header = hdr.StepHeader(cmd=hdr.CMD_FORWARD, slots=[0], offsets=[position], lengths=[n])
        h = sharding.embed(shards[0], tokens)
        per_layer = sharding.per_layer_inputs(shards[0], tokens, h)
        header.sides = [hdr.SideArray(hdr.SIDE_PER_LAYER, "float32", tuple(per_layer.shape))]
        sides = [per_layer]
        for shard, c in zip(shards, caches, strict=True):
            header = hdr.decode(hdr.encode(header))
            assert header.sides[0].shape[2] == NUM_LAYERS - shard.start
            h = forward_stage(shard, c, header, h, sides)
            sides = pass_on(header, sides, len(shard.layers))
        position += n
        return sharding.head(shards[0], h)[:, -1]

    return forward


def test_stages_equal_the_whole_model(model):
    """Logits bit-identical to mlx-lm's for a 40-token prefill and 10 decode steps."""
    whole = _whole(model)
    prompt = mx.array([[(7 * i + 11) % 500 + 7 for i in range(40)]])
    steps = [mx.array([[t]]) for t in (9, 99, 199, 299, 399, 13, 31, 71, 171, 271)]
    cache = make_prompt_cache(whole)
    expected = [whole(prompt, cache=cache)[:, -1]] + [whole(t, cache=cache)[:, -1] for t in steps]
    for split in SPLITS:
        shards = [sharding.load_shard(model, a, b, has_ends=a == 0) for a, b in split]
        assert all(s.takes_inputs for s in shards)
        forward = _staged(shards, [SlotCaches(s) for s in shards])
        got = [forward(prompt)] + [forward(t) for t in steps]
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert mx.array_equal(a, b).item(), f"split {split}: step {i} differs"


def test_without_per_layer_inputs_the_logits_differ(model):
    """The check above can fail: the same stages fed no per-layer inputs do not match."""
    whole = _whole(model)
    prompt = mx.array([[(7 * i + 11) % 500 + 7 for i in range(40)]])
    expected = whole(prompt, cache=make_prompt_cache(whole))[:, -1]
    shard = sharding.load_shard(model, 0, NUM_LAYERS, has_ends=True)
    h = sharding.run_layers(shard, sharding.embed(shard, prompt), shard.make_caches())
    assert not mx.allclose(sharding.head(shard, h)[:, -1], expected).item()


def test_only_rank_0_holds_the_per_layer_table(model):
    """Workers drop the per-layer embedding and projection before any weight is read;
    the memory check and the split count them with rank 0's embedding and head."""
    worker = sharding.load_shard(model, 2, NUM_LAYERS, has_ends=False)
    assert "embed_tokens_per_layer" not in worker.inner
    assert "per_layer_model_projection" not in worker.inner
    first = sharding.load_shard(model, 0, 2, has_ends=True)
    assert first.inner.embed_tokens_per_layer is not None
    assert sharding.computes_per_layer_inputs(first)
    rank_0s = [n for n in checkpoint.tensor_bytes(model) if any(p in n for p in ROOT_PARTS)]
    assert len(rank_0s) == 3 and all(checkpoint.layer_of(n) is None for n in rank_0s)


def test_kv_sharing_is_still_refused(tiny_model):
    path = tiny_model("gemma4_text", 4, overrides=(*PER_LAYER, ("num_kv_shared_layers", 1)))
    with pytest.raises(sharding.UnsupportedFamily, match="num_kv_shared_layers"):
        sharding.load_shard(path, 0, 2, has_ends=True)


@pytest.mark.cluster
def test_cluster_equals_mlx_lm(model, cluster_factory):
    """Three uneven ranks (1, 3, 2 layers) with eager hops, whose receivers post each
    side array's receive from the header alone (its shape shrinks at every hop):
    concurrent greedy and seeded streams equal mlx-lm's."""
    running = cluster_factory(model, 3, "--hop-mode", "eager", layers="1,3,2")
    results = generate_concurrently(running.client, [_request(*p) for p in PROMPTS])
    for i, (text, seed) in enumerate(PROMPTS):
        assert results[i] == _oracle(model, text, seed), f"request {i} ({seed=})"
