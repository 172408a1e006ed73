"""gemma4_text in the 2B/4B (E2B/E4B) layouts: per-layer inputs and KV sharing.

Each layer of these models takes, besides the hidden state, its slice of a per-layer
input that the model computes before its first layer from the token ids (a per-layer
embedding table, most of the real models' weights) and the first hidden state
(`hidden_size_per_layer_input`). Rank 0 alone holds that table and computes them every
step; they travel as a side array after the hidden state, and each rank keeps its own
layers' slices and passes the rest on (step_inputs.pass_on). Their last layers
(`num_kv_shared_layers`) have no keys and values of their own: each reuses those the
last earlier layer of its kind computed in the same step, so the last rank holds them
with the layers they reuse (a split mlx-relay chooses moves layers there; one a user
gives otherwise is refused at load). Checked on tiny random gemma4_text models against
single-process mlx-lm: logits bit-identical at 1, 2 and 3 uneven stages, and a 3-rank
cluster's concurrent greedy and seeded streams token-exact.
"""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest
from family_checks import SPLITS, family_oracle, family_request, whole_model
from mlx_lm.models.cache import make_prompt_cache
from oracle import generate_concurrently
from staged import Staged, greedy_forward
from tiny_models import VOCAB_SIZE

from mlx_relay.coordinator.pipeline import Pipeline
from mlx_relay.model import checkpoint, memory, sharding
from mlx_relay.model.split import default_split, keep_kv_shared_together, model_layers

NUM_LAYERS = 6
PER_LAYER = (("hidden_size_per_layer_input", 8), ("vocab_size_per_layer_input", VOCAB_SIZE))
# Layers 4 (sliding) and 5 (full) reuse layers 3 and 2: the last rank holds [2, 6).
KV_SHARED = (*PER_LAYER, ("num_kv_shared_layers", 2))
TAIL = 4
# Uneven splits whose last rank holds the shared layers with the layers they reuse.
SHARED_SPLITS = ([(0, 6)], [(0, 2), (2, 6)], [(0, 1), (1, 2), (2, 6)])
ROOT_PARTS = ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm")
PROMPTS = [("Tell me about the sea.", None), ("Write add(a, b) in Python.", 21)]


@pytest.fixture(scope="module")
def model(tiny_model):
    """The E2B/E4B layout: per-layer inputs and KV sharing."""
    return tiny_model("gemma4_text", NUM_LAYERS, overrides=KV_SHARED)


@pytest.fixture(scope="module")
def wrapped(model, tmp_path_factory):
    """The same model as a Gemma 4 checkpoint: model_type gemma4, the text model's
    settings nested in text_config and its weights under `language_model.` (mlx-lm's
    gemma4 wraps gemma4_text and drops the vision and audio towers on load)."""
    path = tmp_path_factory.mktemp("gemma4") / "wrapped"
    shutil.copytree(model, path)
    text = json.loads((model / "config.json").read_text())
    config = {"model_type": "gemma4", "vocab_size": text["vocab_size"], "text_config": text}
    (path / "config.json").write_text(json.dumps(config))
    for f in path.glob("*.safetensors"):
        weights = {f"language_model.{k}": v for k, v in mx.load(str(f)).items()}
        mx.save_safetensors(str(f), weights, metadata={"format": "mlx"})
    index = path / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {f"language_model.{k}": v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(("overrides", "splits"), [(PER_LAYER, SPLITS), (KV_SHARED, SHARED_SPLITS)])
def test_stages_equal_the_whole_model(tiny_model, overrides, splits):
    """Logits bit-identical to mlx-lm's for a 40-token prefill and 10 decode steps, with
    per-layer inputs alone (any split) and with KV sharing too."""
    model = tiny_model("gemma4_text", NUM_LAYERS, overrides=overrides)
    whole = whole_model(model)
    prompt = mx.array([[(7 * i + 11) % 500 + 7 for i in range(40)]])
    steps = [mx.array([[t]]) for t in (9, 99, 199, 299, 399, 13, 31, 71, 171, 271)]
    cache = make_prompt_cache(whole)
    expected = [whole(prompt, cache=cache)[:, -1]] + [whole(t, cache=cache)[:, -1] for t in steps]
    for split in splits:
        staged = Staged(model, split)
        shards = staged.shards
        assert all(s.takes_inputs for s in shards)
        assert [len(s.make_caches()) for s in shards][-1] == split[-1][1] - split[-1][0] - (
            2 if overrides == KV_SHARED else 0
        )
        forward = greedy_forward(staged)
        got = [forward(prompt)]
        # (each rank receives the per-layer inputs of its layers and the later ones')
        assert [h.sides[0].shape[2] for h in staged.hops[:-1]] == [
            NUM_LAYERS - a for a, _ in split[1:]
        ]
        got += [forward(t) for t in steps]
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert mx.array_equal(a, b).item(), f"split {split}: step {i} differs"


def test_a_gemma4_checkpoint_splits_as_its_text_model(wrapped):
    """model_type gemma4 (a real Gemma 4 checkpoint's) gets every rule of gemma4_text,
    whose decoder it wraps: per-layer inputs, KV sharing, soft-capped logits."""
    whole = whole_model(wrapped)
    prompt = mx.array([[(7 * i + 11) % 500 + 7 for i in range(40)]])
    steps = [mx.array([[t]]) for t in (9, 99, 199)]
    cache = make_prompt_cache(whole)
    expected = [whole(prompt, cache=cache)[:, -1]] + [whole(t, cache=cache)[:, -1] for t in steps]
    assert sharding.kv_shared_tail(sharding.read_config(wrapped)) == TAIL
    for split in SHARED_SPLITS:
        staged = Staged(wrapped, split)
        assert all(s.takes_inputs for s in staged.shards)
        forward = greedy_forward(staged)
        got = [forward(prompt)] + [forward(t) for t in steps]
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert mx.array_equal(a, b).item(), f"split {split}: step {i} differs"


def test_without_per_layer_inputs_the_logits_differ(model):
    """The check above can fail: the same stages fed no per-layer inputs do not match."""
    whole = whole_model(model)
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


def test_kv_shared_layers_stay_with_the_layers_they_reuse(model):
    """A rank holding a KV-shared layer without the layer it reuses is refused at load,
    naming both; the named splits (the default `balanced`, `even`) give the last rank
    those layers and split the rest their own way, a split by memory moves layers there,
    and counts a user gives that part them are refused before any rank loads."""
    assert sharding.kv_shared_tail(sharding.read_config(model)) == TAIL
    with pytest.raises(sharding.UnsupportedFamily, match="layer 5 reuses layer 2's keys"):
        sharding.load_shard(model, 3, NUM_LAYERS, has_ends=False)
    for spec in ("balanced", "even"):
        assert model_layers(spec, str(model), 2)[-1] == TAIL
        assert model_layers(spec, str(model), 3)[-1] == TAIL
    assert default_split(model, NUM_LAYERS, 3)[-1] == TAIL
    assert model_layers("1,5", str(model), 2) == [1, 5]
    with pytest.raises(ValueError, match="the last rank must hold at least 4 layers"):
        model_layers("3,3", str(model), 2)
    with pytest.raises(ValueError, match="must stay on one rank"):
        model_layers("even", str(model), 4)
    assert keep_kv_shared_together(model, [3, 3], computed=True) == [2, 4]
    assert keep_kv_shared_together(model, [2, 2, 2], computed=True) == [1, 1, 4]
    with pytest.raises(ValueError, match="the last rank must hold at least 4 layers"):
        keep_kv_shared_together(model, [3, 3], computed=False)
    with pytest.raises(ValueError, match="must stay on one rank"):
        keep_kv_shared_together(model, [1, 1, 1, 3], computed=True)


def test_the_memory_check_counts_no_cache_for_kv_shared_layers(model):
    """The last rank holds every KV-shared layer, none of which keeps a cache."""
    shard = sharding.load_shard(model, 2, NUM_LAYERS, has_ends=False)
    held = sum(1 for c in shard.make_caches() if c is not None)
    one = memory.cache_nbytes(model, 2, 3, 256)
    assert memory.cache_nbytes(model, 2, NUM_LAYERS, 256) <= held * one


def test_per_layer_inputs_keep_their_own_dtype(model, tmp_path):
    """A checkpoint whose embedding is bfloat16 and per-layer parts float32: the side
    array is announced with its own dtype, so the ring accepts it."""
    mixed = tmp_path / "mixed"
    shutil.copytree(model, mixed)
    for f in mixed.glob("*.safetensors"):
        weights = mx.load(str(f))
        for name in weights:
            if name.endswith("embed_tokens.weight"):
                weights[name] = weights[name].astype(mx.bfloat16)
        mx.save_safetensors(str(f), weights, metadata={"format": "mlx"})
    shard = sharding.load_shard(mixed, 0, 2, has_ends=True)
    tokens = mx.array([[5, 6, 7]])
    h = sharding.embed(shard, tokens)
    per_layer = sharding.per_layer_inputs(shard, tokens, h)
    assert h.dtype == mx.bfloat16 and per_layer.dtype == mx.float32
    pipeline = Pipeline(None, None)
    pipeline.load(str(mixed))
    step = pipeline.launch_forward([0], [0], tokens, [3], want_logits=True)
    assert step.header.sides[0].dtype == "float32"


@pytest.mark.cluster
def test_cluster_equals_mlx_lm(model, cluster_pool):
    """Three uneven ranks with eager hops, whose receivers post each side array's
    receive from the header alone (its shape shrinks at every hop), the default split
    moved so that the last rank holds the KV-shared layers: concurrent greedy and seeded
    streams equal mlx-lm's."""
    running = cluster_pool.serving(model, 3, "--hop-mode", "eager")
    ranks = sorted(running.client.status().ranks, key=lambda r: r.rank)
    assert ranks[-1].layer_start <= NUM_LAYERS - TAIL, ranks
    results = generate_concurrently(running.client, [family_request(*p) for p in PROMPTS])
    for i, (text, seed) in enumerate(PROMPTS):
        assert results[i] == family_oracle(model, text, seed), f"request {i} ({seed=})"


@pytest.mark.cluster
def test_a_gemma4_checkpoint_in_a_cluster_equals_mlx_lm(wrapped, cluster_pool):
    """Two ranks on the default split of a gemma4 checkpoint: concurrent greedy and
    seeded streams equal mlx-lm's."""
    running = cluster_pool.serving(wrapped, 2)
    results = generate_concurrently(running.client, [family_request(*p) for p in PROMPTS])
    for i, (text, seed) in enumerate(PROMPTS):
        assert results[i] == family_oracle(wrapped, text, seed), f"request {i} ({seed=})"
