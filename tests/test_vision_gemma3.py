"""Gemma 3's vision-language model: a second VLM family, split over ranks like llava.

Gemma 3 differs from llava where a split could go wrong: its language model scales the
input embeddings (image features merged in) by sqrt(hidden) inside its forward, its image
prompt is a begin-of-image marker the processor expands to soft image tokens, and its
layers alternate sliding-window and full attention (the caches must stay windows). The
oracle is single-process mlx-vlm on a tiny random-weight gemma3 made here (a 2-layer
SigLIP tower, 28x28 images pooled to 4 image tokens, a 4-layer gemma3 text model whose
window of 16 positions is shorter than the image prompt): greedy tokens equal at 1 and 2
uneven ranks, in process and through a real cluster.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason="the vision extra (mlx-vlm) is not installed")

import mlx.core as mx  # noqa: E402
from conftest import start_cluster  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_vlm.models import gemma3  # noqa: E402
from tiny_models import (  # noqa: E402
    CHAT_TEMPLATE,
    _config,
    _init_weights,
    add_special_tokens,
    write_tokenizer,
)
from vlm_oracle import (  # noqa: E402
    checkpoint_weights,
    image_request,
    inputs,
    layer_bytes,
    mlx_vlm_tokens,
    png,
    prompt_text,
    staged_tokens,
)

from mlx_relay.model import memory, sharding, split  # noqa: E402

NUM_LAYERS = 4
WINDOW = 16  # sliding window of the local layers: the image prompt is longer
BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
IMAGE_SIZE, PATCH_SIZE, IMAGE_TOKENS = 28, 7, 4  # 4x4 patches pooled to 2x2 tokens

# The text models' template, with Gemma 3's begin-of-image marker for image parts.
TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- for part in content if part.type == 'text' %}{{- part.text }}{%- endfor %}",
    "{%- for part in content %}{%- if part.type in ('image', 'image_url') %}"
    "{{- '" + BOI + "' }}{%- elif part.type == 'text' %}{{- part.text }}{%- endif %}"
    "{%- endfor %}",
)
assert TEMPLATE != CHAT_TEMPLATE


def make_tiny_gemma3_vlm(
    path: Path, *, num_layers: int = NUM_LAYERS, hidden_size: int = 64, seed: int = 0
) -> Path:
    """A tiny random-weight Gemma 3 VLM in mlx-vlm's layout, with its processor files."""
    path = write_tokenizer(path)
    ids = add_special_tokens(
        path,
        (BOI, EOI, SOFT),
        TEMPLATE,
        {"boi_token": BOI, "eoi_token": EOI, "image_token": SOFT},
    )

    vocab = ids[SOFT] + 1
    text = _config("gemma3_text", num_layers, hidden_size, True, WINDOW, 2)
    text.update(vocab_size=vocab, mm_tokens_per_image=IMAGE_TOKENS, rope_scaling=None)
    config = {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "image_token_index": ids[SOFT],
        "boi_token_index": ids[BOI],
        "eoi_token_index": ids[EOI],
        "mm_tokens_per_image": IMAGE_TOKENS,
        "hidden_size": text["hidden_size"],
        "vocab_size": vocab,
        "pad_token_id": text["pad_token_id"],
        "eos_token_id": text["eos_token_id"],
        "torch_dtype": "float32",
        "text_config": text,
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": IMAGE_SIZE,
            "patch_size": PATCH_SIZE,
            "num_channels": 3,
            "layer_norm_eps": 1e-6,
        },
    }
    model_config = gemma3.ModelConfig.from_dict(config)
    model_config.text_config = gemma3.TextConfig.from_dict(text)
    model_config.vision_config = gemma3.VisionConfig.from_dict(config["vision_config"])
    model = gemma3.Model(model_config)
    _init_weights(model, seed, gemma=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    processor = {
        "image_processor_type": "SiglipImageProcessor",
        "processor_class": "Gemma3Processor",
        "do_resize": True,
        "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "resample": 2,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    extra = {"processor_class": "Gemma3Processor", "image_seq_length": IMAGE_TOKENS}
    (path / "processor_config.json").write_text(json.dumps(extra, indent=2))
    return path


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    return make_tiny_gemma3_vlm(tmp_path_factory.mktemp("gemma3-vlm"))


def test_the_tiny_model_is_what_it_claims(vlm):
    """The image prompt is longer than the window; an image is 4 soft tokens between the
    markers; the layers alternate sliding and full caches."""
    ids = np.asarray(inputs(vlm, [png(1)])["input_ids"]).reshape(-1).tolist()
    config = sharding.read_config(vlm)
    assert ids.count(config["image_token_index"]) == IMAGE_TOKENS
    assert len(ids) > WINDOW
    shard = sharding.load_shard(vlm, 0, NUM_LAYERS, has_ends=True)
    kinds = [sharding.mask_kind(c) for c in shard.make_caches()]
    assert kinds == [sharding.SLIDING, sharding.FULL] * (NUM_LAYERS // 2)


def test_stages_equal_mlx_vlm(vlm):
    """In process: rank 0's merged (and scaled) embeddings, the decoder cut into stages
    with their own caches, greedy tokens equal to mlx-vlm's; later stages hold no tower."""
    image = png(1)
    want = mlx_vlm_tokens(vlm, [image])
    for ranges in ([(0, 4)], [(0, 1), (1, 4)], [(0, 3), (3, 4)]):
        got = staged_tokens(vlm, image, prompt_text(vlm, 1), ranges)
        assert got == want, f"split {ranges}"


def test_the_tower_is_rank_0s_in_the_byte_counts(vlm):
    weights = checkpoint_weights(vlm)
    layer = layer_bytes(weights, NUM_LAYERS)
    costs = split.layer_costs(vlm, NUM_LAYERS, sharding.read_config(vlm))
    assert costs is not None and costs.held == layer
    total = sum(a.nbytes for a in weights.values())
    assert memory.shard_nbytes(vlm, 0, 1, ends=True) + memory.shard_nbytes(vlm, 1, 4) == total


@pytest.fixture(scope="module", params=[(1, None, 512), (2, "1,3", 6)], ids=["1rank", "2ranks"])
def cluster(request, vlm, tmp_path_factory):
    ranks, layers, chunk = request.param
    running = start_cluster(
        vlm,
        ranks,
        tmp_path_factory.mktemp("logs"),
        "--prefill-chunk",
        str(chunk),
        layers=layers,
    )
    yield running
    running.stop()


@pytest.mark.cluster
def test_image_chats_equal_mlx_vlm(vlm, cluster):
    """Two images at once (their sliding-window caches batched), then a text-only chat:
    mlx-vlm's greedy tokens."""
    images = [png(2), png(3, (20, 50))]
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda i: cluster.client.generate(image_request([i])), images))
    for image, answer in zip(images, answers, strict=True):
        assert list(answer.token_ids) == mlx_vlm_tokens(vlm, [image])
    text = list(cluster.client.generate(image_request([])).token_ids)
    assert text == mlx_vlm_tokens(vlm, [])
