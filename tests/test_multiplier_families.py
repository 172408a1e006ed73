"""Families whose own forward scales embeddings and/or logits by config multipliers
around the layers (granite, minicpm, cohere, afmoe, gear, muse_glimmer ...), or calls
its layers otherwise than (x, mask, cache) or names its decoder's parts otherwise
(gemma4_text, falcon_h1, nanochat): rank 0's embed and head and every rank's layers do
exactly what each model's `__call__` does, so clusters give single-process mlx-lm's
tokens at 1, 2 and 3 uneven ranks, greedy and seeded.

One cluster per rank count (the session's pool: conftest.ClusterPool); each family is
loaded into it in turn (Free, LoadModel), much cheaper than starting rank processes.
"""

from __future__ import annotations

import importlib
import json

import mlx.core as mx
import pytest
from family_checks import family_oracle, family_request
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, make_prompt_cache
from mlx_lm.utils import load_model
from oracle import generate_concurrently
from staged import Staged, greedy_forward
from tiny_models import (
    ADAPTED_FAMILIES,
    MULTIPLIER_FAMILIES,
    ROW_BY_ROW_FAMILIES,
    _init_weights,
    make_tiny_model,
)

NUM_LAYERS = 6
LAYERS = {1: None, 2: "2,4", 3: "1,3,2"}  # uneven
PROMPTS = [("Tell me about the sea.", None), ("Write add(a, b) in Python.", 21)]


@pytest.fixture(scope="module")
def models(tiny_model):
    families = MULTIPLIER_FAMILIES + ADAPTED_FAMILIES + ROW_BY_ROW_FAMILIES
    return {family: tiny_model(family, NUM_LAYERS) for family in families}


@pytest.mark.cluster
@pytest.mark.parametrize("ranks", sorted(LAYERS))
def test_clusters_equal_mlx_lm(models, cluster_pool, ranks):
    layers = LAYERS[ranks]
    for family, path in models.items():
        client = cluster_pool.serving(path, ranks, layers=layers).client
        got = generate_concurrently(client, [family_request(*p) for p in PROMPTS])
        for (text, seed), tokens in zip(PROMPTS, got, strict=True):
            assert tokens == family_oracle(path, text, seed), f"{family} at {ranks} ranks, {seed=}"
        status = client.status()
        assert status.active_requests == 0 and status.queued_requests == 0


def test_gear_conv_mixer_layers_stage_exact(tmp_path):
    """gear with its conv-mixer layers (ArraysCache state) between sliding and full
    attention, which the tiny gear of the cluster test leaves out (transformers refuses
    that layer type in config.json, so mlx_lm.load cannot read its tokenizer): stages
    cut unevenly give the whole model's logits bit for bit (mlx-lm's load_model)."""
    path = make_tiny_model(tmp_path / "gear", "gear", num_layers=NUM_LAYERS)
    config = json.loads((path / "config.json").read_text())
    kinds = ("conv_mixer", "sliding_attention", "full_attention")
    config["layer_types"] = [kinds[i % 3] for i in range(NUM_LAYERS)]
    arch = importlib.import_module("mlx_lm.models.gear")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    _init_weights(model, 0, gemma=False)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config))
    model = load_model(path)[0]
    assert isinstance(make_prompt_cache(model)[0], ArraysCache)
    prompt = mx.array([[(7 * i + 11) % 500 + 7 for i in range(40)]])
    steps = [mx.array([[t]]) for t in (9, 99, 199, 299, 399, 13, 31, 71, 171, 271)]
    cache = make_prompt_cache(model)
    expected = [model(prompt, cache=cache)[:, -1]] + [model(t, cache=cache)[:, -1] for t in steps]
    for split in ([(0, 2), (2, 6)], [(0, 1), (1, 4), (4, 6)]):
        forward = greedy_forward(Staged(path, split, housekeeping=False))  # (the ranks' loop)
        got = [forward(prompt)] + [forward(t) for t in steps]
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert mx.array_equal(a, b).item(), f"gear split {split}: step {i} differs"
