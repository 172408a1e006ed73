"""Qwen2-VL and Qwen2.5-VL: a VLM whose layers take more than the hidden state.

Their attention rotates queries and keys by multimodal rope positions (temporal,
height, width) that mlx-vlm's language model computes from the image grid, which only
rank 0 sees; decode positions are offset + a per-sequence rope delta fixed at prefill.
Rank 0 sends a prompt's positions with each prefill chunk (a side array after the
hidden state) and the delta in every header (protocol/header.py). The oracle is
single-process mlx-vlm on tiny random models made here (tiny_qwen_vl.py): images of
two sizes give 2x3 and other grids of image tokens, whose positions are not a count.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason="the vision extra (mlx-vlm) is not installed")

from conftest import start_cluster  # noqa: E402
from tiny_qwen_vl import QWEN_VL_FAMILIES, make_tiny_qwen_vl  # noqa: E402
from vlm_oracle import (  # noqa: E402
    MAX_TOKENS,
    QUESTION,
    checkpoint_weights,
    layer_bytes,
    loaded,
    mlx_vlm_tokens,
    png,
    prompt_text,
    staged_tokens,
)

from mlx_relay.coordinator.pipeline import Pipeline  # noqa: E402
from mlx_relay.model import memory, sharding, split, vision  # noqa: E402
from mlx_relay.model.step_inputs import PromptInputs  # noqa: E402
from mlx_relay.protocol import header as hdr  # noqa: E402
from mlx_relay.protocol import relay_pb2 as pb  # noqa: E402

NUM_LAYERS = 4
CLUSTER_FAMILY = "qwen2_5_vl"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return {f: make_tiny_qwen_vl(tmp_path_factory.mktemp(f), f) for f in QWEN_VL_FAMILIES}


@pytest.mark.parametrize("family", QWEN_VL_FAMILIES)
def test_positions_are_not_a_count(models, family):
    """The tiny model exercises what matters: the image's tokens sit on a grid (their
    positions repeat along the three axes), so the prompt's rope delta is not zero."""
    path = models[family]
    encoded = vision.processor_for(str(path)).encode(prompt_text(path, 1), [png(1)])
    model, _ = loaded(str(path))
    prompt = vision.prompt_inputs(model, encoded.token_ids, encoded.pixel_values)
    positions = np.asarray(prompt.positions)
    assert positions.shape == (3, 1, len(encoded.token_ids))
    assert prompt.delta < 0 and not (positions[0] == positions[1]).all()


@pytest.mark.parametrize("family", QWEN_VL_FAMILIES)
def test_stages_equal_mlx_vlm(models, family):
    """In process: rank 0's merged embeddings and positions, the decoder cut into 1 and 2
    uneven stages, prefill whole and in chunks of 5 (a chunk's positions are its slice):
    greedy tokens equal to mlx-vlm's."""
    path = models[family]
    image = png(1)
    want = mlx_vlm_tokens(path, [image])
    for ranges, chunk in (([(0, 4)], 0), ([(0, 1), (1, 4)], 5), ([(0, 3), (3, 4)], 0)):
        got = staged_tokens(path, image, prompt_text(path, 1), ranges, chunk)
        assert got == want, f"{family} split {ranges} chunk {chunk}"


def test_workers_hold_no_vision_tower(models):
    shard = sharding.load_shard(models["qwen2_vl"], 1, 4, has_ends=False)
    assert shard.vision and "vision_tower" not in shard.model


@pytest.fixture(scope="module", params=["eager", "ready", "adaptive"])
def cluster(request, models, tmp_path_factory):
    """Two ranks in each hop mode: eager posts every receive (side arrays included) when
    the header arrives, so their shapes must be in it; ready posts them once sent;
    adaptive sends a step's side arrays the way its header says its payload goes."""
    hops = request.param
    running = start_cluster(
        models[CLUSTER_FAMILY],
        2,
        tmp_path_factory.mktemp("logs"),
        "--prefill-chunk",
        "6",
        "--hop-mode",
        hops,
        layers="1,3",
    )
    assert running.logs().count(f"{hops} hops") == 2, running.logs()
    yield running
    running.stop()


def _request(images: list[bytes], text: str = QUESTION, system: str = "") -> pb.GenerateRequest:
    messages = [pb.ChatMessage(role="system", content=system)] if system else []
    messages.append(pb.ChatMessage(role="user", content=text, images=images))
    return pb.GenerateRequest(messages=messages, params=pb.SamplingParams(max_tokens=MAX_TOKENS))


@pytest.mark.cluster
def test_image_chats_equal_mlx_vlm(models, cluster):
    """Two ranks (`--layers 1,3`, prefill chunks of 6): an image chat alone, then two
    image chats of different grids and a text-only chat at once (decoded in one batch,
    each row at its own delta): mlx-vlm's greedy tokens."""
    path = models[CLUSTER_FAMILY]
    first = list(cluster.client.generate(_request([png(1)])).token_ids)
    assert first == mlx_vlm_tokens(path, [png(1)])
    chats = [[png(2)], [png(3, (20, 50))], []]
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda i: cluster.client.generate(_request(i)), chats))
    for images, answer in zip(chats, answers, strict=True):
        assert list(answer.token_ids) == mlx_vlm_tokens(path, images)


def test_rank_0_sends_positions_with_the_prompt_and_the_delta_with_every_step(models):
    """Rank 0's pipeline: an image prompt's chunk lists its positions as a side array;
    the sequence's later steps (a decode group) carry its rope delta in the header and
    nothing else; once the slot is freed, a text sequence there has neither."""
    path = models["qwen2_vl"]
    pipeline = Pipeline(None, None)
    pipeline.load(str(path))
    encoded = vision.processor_for(str(path)).encode(prompt_text(path, 1), [png(1)])
    prompt = vision.prompt_inputs(pipeline.shard.model, encoded.token_ids, encoded.pixel_values)
    n = len(encoded.token_ids)
    ids = mx.array([encoded.token_ids])
    step = pipeline.launch_forward([5], [0], ids, [n], want_logits=True, prompt=prompt)
    assert step.header.sides == [hdr.SideArray(hdr.SIDE_POSITIONS, "int32", (3, 1, n))]
    token = mx.argmax(pipeline.complete(step).logits, axis=-1)[:, None]
    step = pipeline.launch_forward([5], [n], token, [1], group=0, want_logits=True)
    assert step.header.sides == [] and step.header.deltas == [prompt.delta]
    pipeline.complete(step)
    pipeline.launch_free([5])
    step = pipeline.launch_forward([5], [0], ids[:, :4], [4], want_logits=False)
    assert step.header.sides == [] and step.header.deltas == []
    pipeline.complete(step)


def test_the_tower_is_rank_0s_in_the_byte_counts(models):
    path = models["qwen2_5_vl"]
    weights = checkpoint_weights(path)
    layer = layer_bytes(weights, NUM_LAYERS)
    costs = split.layer_costs(path, NUM_LAYERS, sharding.read_config(path))
    assert costs is not None and costs.held == layer
    total = sum(a.nbytes for a in weights.values())
    assert memory.shard_nbytes(path, 0, 1, ends=True) + memory.shard_nbytes(path, 1, 4) == total


@pytest.mark.parametrize("family", QWEN_VL_FAMILIES)
def test_the_positions_and_the_delta_both_matter(models, family, monkeypatch):
    """The oracle tells a wrong position apart: a stage run on plain positions (no side
    array) or without the rope delta gives other tokens than mlx-vlm's."""
    path = models[family]
    want = mlx_vlm_tokens(path, [png(1)])
    real = vision.prompt_inputs
    for wrong in (
        lambda *a: PromptInputs(real(*a).embeddings),
        lambda *a: dataclasses.replace(real(*a), delta=0),
    ):
        monkeypatch.setattr(vision, "prompt_inputs", wrong)
        got = staged_tokens(path, png(1), prompt_text(path, 1), [(0, 1), (1, 4)])
        assert got[:3] != want[:3]


@pytest.mark.cluster
def test_an_image_chat_reusing_a_text_prefix(models, cluster):
    """A text chat leaves its caches behind; an image chat sharing its system prompt
    reuses them up to its first image token and prefills the rest at its own positions
    (sliced from the whole prompt's, from the reused length on): mlx-vlm's tokens."""
    path = models[CLUSTER_FAMILY]
    system = "You are a helpful assistant. " * 4
    text = cluster.client.generate(_request([], "Hello!", system))
    assert list(text.token_ids) == mlx_vlm_tokens(path, [], "Hello!", system)
    reply = cluster.client.generate(_request([png(4)], system=system))
    assert list(reply.token_ids) == mlx_vlm_tokens(path, [png(4)], system=system)
    assert reply.usage.cached_tokens > 16, "the system prompt's caches served"


@pytest.mark.cluster
def test_the_same_image_chat_again_reuses_its_caches_and_keeps_its_delta(models, cluster):
    """An image chat's caches are parked under its image's contents: asked again, all of
    its prompt but the last token is reused, that token's step carries the whole prompt's
    rope delta, and decoding goes on at it: mlx-vlm's tokens; another image reuses none
    of the image's positions."""
    path = models[CLUSTER_FAMILY]
    first = cluster.client.generate(_request([png(5)]))
    assert list(first.token_ids) == mlx_vlm_tokens(path, [png(5)])
    again = cluster.client.generate(_request([png(5)]))
    assert list(again.token_ids) == list(first.token_ids)
    assert again.usage.cached_tokens == first.usage.prompt_tokens - 1
    other = cluster.client.generate(_request([png(6, (20, 50))]))
    assert list(other.token_ids) == mlx_vlm_tokens(path, [png(6, (20, 50))])
    assert other.usage.cached_tokens < first.usage.prompt_tokens - 1
