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

import io
import json
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason="the vision extra (mlx-vlm) is not installed")

import mlx.core as mx  # noqa: E402
from conftest import start_cluster  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_vlm.generate.ar import generate_step  # noqa: E402
from mlx_vlm.models import gemma3  # noqa: E402
from mlx_vlm.utils import load_model, load_processor  # noqa: E402
from PIL import Image  # noqa: E402
from tiny_models import CHAT_TEMPLATE, _config, _init_weights, write_tokenizer  # noqa: E402

from mlx_relay.model import memory, sharding, split, vision  # noqa: E402
from mlx_relay.protocol import relay_pb2 as pb  # noqa: E402

MAX_TOKENS = 12
NUM_LAYERS = 4
WINDOW = 16  # sliding window of the local layers: the image prompt is longer
QUESTION = "Describe the picture."
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
    tokenizer = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    config_json = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    ids = {}
    for token in (BOI, EOI, SOFT):
        ids[token] = len(tokenizer["model"]["vocab"]) + len(ids)
        added = {
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        tokenizer["added_tokens"].append({"id": ids[token], **added})
        config_json["added_tokens_decoder"][str(ids[token])] = added
    config_json["extra_special_tokens"] = {"boi_token": BOI, "eoi_token": EOI, "image_token": SOFT}
    config_json["chat_template"] = TEMPLATE
    (path / "tokenizer.json").write_text(json.dumps(tokenizer), encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(config_json, indent=2))

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


def _png(seed: int, size: tuple[int, int] = (40, 32)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    return make_tiny_gemma3_vlm(tmp_path_factory.mktemp("gemma3-vlm"))


@lru_cache(maxsize=2)
def _mlx_vlm(path: str):
    return load_model(Path(path)), load_processor(Path(path))


def _prompt_text(path: Path, images: int, text: str = QUESTION) -> str:
    _, processor = _mlx_vlm(str(path))
    content = [{"type": "image"}] * images + [{"type": "text", "text": text}]
    messages = [{"role": "user", "content": content if images else text}]
    return processor.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def _inputs(path: Path, images: list[bytes], text: str = QUESTION):
    _, processor = _mlx_vlm(str(path))
    pictures = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    return processor(text=[_prompt_text(path, len(images), text)], images=pictures or None)


def mlx_vlm_tokens(path: Path, images: list[bytes], text: str = QUESTION) -> list[int]:
    """Single-process mlx-vlm: its processor, its model and caches, its greedy decoding."""
    model, _ = _mlx_vlm(str(path))
    inputs = _inputs(path, images, text)
    pixels = mx.array(inputs["pixel_values"]) if images else None
    mask = mx.array(inputs["attention_mask"])
    steps = generate_step(
        mx.array(inputs["input_ids"]), model, pixels, mask, max_tokens=MAX_TOKENS, temperature=0.0
    )
    return [int(token) for token, _ in steps]


def test_the_tiny_model_is_what_it_claims(vlm):
    """The image prompt is longer than the window; an image is 4 soft tokens between the
    markers; the layers alternate sliding and full caches."""
    ids = np.asarray(_inputs(vlm, [_png(1)])["input_ids"]).reshape(-1).tolist()
    config = sharding.read_config(vlm)
    assert ids.count(config["image_token_index"]) == IMAGE_TOKENS
    assert len(ids) > WINDOW
    shard = sharding.load_shard(vlm, 0, NUM_LAYERS, has_ends=True)
    kinds = [sharding.mask_kind(c) for c in shard.make_caches()]
    assert kinds == [sharding.SLIDING, sharding.FULL] * (NUM_LAYERS // 2)


def test_stages_equal_mlx_vlm(vlm):
    """In process: rank 0's merged (and scaled) embeddings, the decoder cut into stages
    with their own caches, greedy tokens equal to mlx-vlm's; later stages hold no tower."""
    image = _png(1)
    want = mlx_vlm_tokens(vlm, [image])
    encoded = vision.processor_for(str(vlm)).encode(_prompt_text(vlm, 1), [image])
    for ranges in ([(0, 4)], [(0, 1), (1, 4)], [(0, 3), (3, 4)]):
        shards = [sharding.load_shard(vlm, a, b, has_ends=a == 0) for a, b in ranges]
        assert all("vision_tower" not in s.model for s in shards[1:])
        caches = [s.make_caches() for s in shards]
        h = vision.input_embeddings(shards[0].model, encoded.token_ids, encoded.pixel_values)
        got = []
        for _ in range(MAX_TOKENS):
            for shard, c in zip(shards, caches, strict=True):
                h = sharding.run_layers(shard, h, c)
            token = int(mx.argmax(sharding.head(shards[0], h)[:, -1], axis=-1).item())
            got.append(token)
            h = sharding.embed(shards[0], mx.array([[token]]))
        assert got == want, f"split {ranges}"


def test_the_tower_is_rank_0s_in_the_byte_counts(vlm):
    weights: dict[str, mx.array] = {}
    for f in vlm.glob("*.safetensors"):
        weights.update(mx.load(str(f)))
    layer = [
        sum(
            a.nbytes
            for k, a in weights.items()
            if k.startswith(f"language_model.model.layers.{i}.")
        )
        for i in range(NUM_LAYERS)
    ]
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


def _request(images: list[bytes], text: str = QUESTION) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content=text, images=images)],
        params=pb.SamplingParams(max_tokens=MAX_TOKENS),
    )


@pytest.mark.cluster
def test_image_chats_equal_mlx_vlm(vlm, cluster):
    """Two images at once (their sliding-window caches batched), then a text-only chat:
    mlx-vlm's greedy tokens."""
    images = [_png(2), _png(3, (20, 50))]
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda i: cluster.client.generate(_request([i])), images))
    for image, answer in zip(images, answers, strict=True):
        assert list(answer.token_ids) == mlx_vlm_tokens(vlm, [image])
    text = list(cluster.client.generate(_request([])).token_ids)
    assert text == mlx_vlm_tokens(vlm, [])
