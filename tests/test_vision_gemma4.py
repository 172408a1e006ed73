"""Gemma 4's vision-language model, split over ranks (issue 13's last vision family).

Gemma 4 differs from the other VLMs where a split could go wrong: an image's tokens
attend to each other both ways (`use_bidirectional_attention: "vision"`), which
mlx-vlm's mask does only in an unchunked prefill from position 0, so an image prompt
goes round whole and its token types travel with it (a side array) for every rank to
build mlx-vlm's mask; its E2B/E4B layouts' per-layer inputs of an image prompt come
from mlx-vlm's get_input_embeddings (the image tokens' ids zeroed), and their KV-shared
last layers stay on the last rank with the layers they reuse. The oracle is
single-process mlx-vlm on a tiny random-weight Gemma 4 made here (tiny_gemma4_vl.py):
greedy tokens equal at 1, 2 and 3 uneven ranks, in process and through a real cluster
whose prefill chunks (6 tokens) are shorter than the image prompt.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason="the vision extra (mlx-vlm) is not installed")

import mlx.core as mx  # noqa: E402
from conftest import start_cluster  # noqa: E402
from mlx_vlm.generate.ar import generate_step  # noqa: E402
from tiny_gemma4_vl import (  # noqa: E402
    MAX_SOFT_TOKENS,
    NUM_LAYERS,
    TAIL,
    WINDOW,
    make_tiny_gemma4_vlm,  # noqa: E402
)
from vlm_oracle import (  # noqa: E402
    MAX_TOKENS,
    checkpoint_weights,
    image_request,
    inputs,
    layer_bytes,
    loaded,
    mlx_vlm_tokens,
    png,
    prompt_text,
    staged_tokens,
)

from mlx_relay.coordinator import requests  # noqa: E402
from mlx_relay.model import memory, sharding, split, vision  # noqa: E402

# Uneven splits whose last rank holds the KV-shared layers with the layers they reuse.
SPLITS = ([(0, 6)], [(0, 2), (2, 6)], [(0, 1), (1, 2), (2, 6)])


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    """The E2B/E4B layout: per-layer inputs and KV-shared layers."""
    return make_tiny_gemma4_vlm(tmp_path_factory.mktemp("gemma4-vlm"))


@pytest.fixture(scope="module")
def vlm_plain(tmp_path_factory) -> Path:
    """The 26B/31B layout: neither per-layer inputs nor KV sharing; K = V, MoE."""
    return make_tiny_gemma4_vlm(tmp_path_factory.mktemp("gemma4-vlm-plain"), per_layer=False)


def test_the_tiny_model_is_what_it_claims(vlm):
    """An image is its soft tokens between the markers, the prompt longer than the
    window; the layers alternate sliding and full caches and the last two share KV;
    and mlx-vlm's tokens depend on the image mask (without the token types, mlx-vlm
    chunks the prompt and keeps it causal, and answers otherwise)."""
    encoded = inputs(vlm, [png(1)])
    ids = np.asarray(encoded["input_ids"]).reshape(-1).tolist()
    config = sharding.read_config(vlm)
    assert ids.count(config["image_token_id"]) == 6 <= MAX_SOFT_TOKENS
    assert len(ids) > WINDOW
    assert vision.is_vlm(config) and sharding.kv_shared_tail(config) == TAIL
    assert not vision.is_vlm({k: v for k, v in config.items() if k != "vision_config"})
    shard = sharding.load_shard(vlm, 0, NUM_LAYERS, has_ends=True)
    assert vision.prefills_whole(shard.config) and shard.kv_sources == {4: 3, 5: 2}
    kinds = [sharding.mask_kind(c) for c in shard.make_caches()]
    assert kinds == [sharding.SLIDING, sharding.SLIDING, sharding.FULL, sharding.SLIDING]
    model, _ = loaded(str(vlm))
    steps = generate_step(
        mx.array(encoded["input_ids"]),
        model,
        mx.array(encoded["pixel_values"]),
        mx.array(encoded["attention_mask"]),
        max_tokens=MAX_TOKENS,
        temperature=0.0,
    )
    assert [int(t) for t, _ in steps] != mlx_vlm_tokens(vlm, [png(1)])


@pytest.mark.parametrize("layout", ["per_layer", "plain"])
def test_stages_equal_mlx_vlm(layout, vlm, vlm_plain):
    """In process: rank 0's merged embeddings (and per-layer inputs), the prompt whole
    with its token types, the decoder cut into stages with their own caches: greedy
    tokens equal to mlx-vlm's; later stages hold no tower."""
    path = vlm if layout == "per_layer" else vlm_plain
    for image in (png(1), png(4, (24, 48))):
        want = mlx_vlm_tokens(path, [image])
        for ranges in SPLITS:
            got = staged_tokens(path, image, prompt_text(path, 1), ranges)
            assert got == want, f"split {ranges}"


def test_two_images_of_different_sizes(vlm):
    """Two images in one prompt, of different shapes (the processor gives a list of
    pixel arrays): each image's tokens see each other's, not the other image's."""
    images = [png(1), png(4, (24, 48))]
    want = mlx_vlm_tokens(vlm, images)
    for ranges in SPLITS[1:]:
        assert staged_tokens(vlm, images, prompt_text(vlm, 2), ranges) == want


def test_without_the_towers_weights_it_is_a_text_model(vlm, tmp_path):
    """A Gemma 4 converted to text (mlx-lm keeps the config's vision_config, drops the
    tower's weights) loads through mlx-lm as text, as before, and refuses images."""
    text = tmp_path / "text"
    shutil.copytree(vlm, text)
    weights = mx.load(str(text / "model.safetensors"))
    kept = {k: v for k, v in weights.items() if not k.startswith(vision.ENCODER_PARTS)}
    mx.save_safetensors(str(text / "model.safetensors"), kept, metadata={"format": "mlx"})
    assert vision.is_vlm(sharding.read_config(text))  # (by its config alone)
    shard = sharding.load_shard(text, 0, NUM_LAYERS, has_ends=True)
    assert not shard.vision and type(shard.model).__module__ == "mlx_lm.models.gemma4"
    assert not vision.is_vlm(shard.config)
    prompt = requests.Prompt(text="x", token_ids=[1], images=[png(1)])
    with pytest.raises(requests.InvalidRequest, match="reads text only"):
        requests.encode_images(prompt, str(text), shard.config)


def test_the_towers_are_rank_0s_in_the_byte_counts(vlm):
    """The vision tower and its projector (embed_vision), like the per-layer table,
    count as rank 0's, not as language-model layers; the shards' bytes add up."""
    weights = checkpoint_weights(vlm)
    assert any(k.startswith("embed_vision.") for k in weights)
    layer = layer_bytes(weights, NUM_LAYERS)
    costs = split.layer_costs(vlm, NUM_LAYERS, sharding.read_config(vlm))
    assert costs is not None and costs.held == layer
    total = sum(a.nbytes for a in weights.values())
    assert memory.shard_nbytes(vlm, 0, 2, ends=True) + memory.shard_nbytes(vlm, 2, 6) == total


@pytest.fixture(
    scope="module",
    # (2 ranks: the default split, which gives the last rank the KV-shared tail: 2, 4)
    params=[(1, None, "ready"), (2, None, "ready"), (3, "1,1,4", "eager")],
    ids=["1rank", "2ranks-ready", "3ranks-eager"],
)
def cluster(request, vlm, tmp_path_factory):
    """Eager hops post every receive, the token types' too, when the header comes."""
    ranks, layers, hops = request.param
    logs = tmp_path_factory.mktemp("logs")
    args = ("--prefill-chunk", "6", "--hop-mode", hops)
    running = start_cluster(vlm, ranks, logs, *args, layers=layers)
    if ranks > 1:
        assert running.logs().count(f"{hops} hops") == ranks, running.logs()
        assert f"loaded layers [2, {NUM_LAYERS})" in running.logs(), running.logs()
    yield running
    running.stop()


@pytest.mark.cluster
def test_image_chats_equal_mlx_vlm(vlm, cluster):
    """Two images at once (one prefilled whole while the other decodes), the first
    again (no cached prefix: its mask needs the prompt from position 0), both in one
    chat, then a text-only chat (chunked): mlx-vlm's greedy tokens."""
    images = [png(2), png(3, (20, 50))]
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda i: cluster.client.generate(image_request([i])), images))
    for image, answer in zip(images, answers, strict=True):
        assert list(answer.token_ids) == mlx_vlm_tokens(vlm, [image])
    again = cluster.client.generate(image_request([images[0]]))
    assert list(again.token_ids) == list(answers[0].token_ids)
    both = cluster.client.generate(image_request(images))  # (of different sizes)
    assert list(both.token_ids) == mlx_vlm_tokens(vlm, images)
    text = list(cluster.client.generate(image_request([])).token_ids)
    assert text == mlx_vlm_tokens(vlm, [])
