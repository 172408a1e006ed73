"""Vision-language models: images in chat, encoded on rank 0, the decoder split over ranks.

The oracle is single-process mlx-vlm on the same tiny random-weight llava (made at test
time: a 2-layer CLIP tower, a projector, a 4-layer llama) and the same prompt text and
images: its own processor expands the image token and preprocesses the pixels, and its
own `generate_step` decodes greedily. The cluster must give its tokens exactly, at 1
rank and at 2 uneven ranks (the workers hold language-model layers only).
"""

from __future__ import annotations

import base64
import io
import threading
from functools import lru_cache
from pathlib import Path

import grpc
import numpy as np
import openai
import pytest

pytest.importorskip("mlx_vlm", reason="the vision extra (mlx-vlm) is not installed")

import mlx.core as mx  # noqa: E402
from conftest import start_cluster  # noqa: E402
from mlx_vlm.generate.ar import generate_step  # noqa: E402
from mlx_vlm.utils import load_model, load_processor  # noqa: E402
from PIL import Image  # noqa: E402
from tiny_models import make_tiny_vlm  # noqa: E402

from mlx_relay.launch.local import free_ports  # noqa: E402
from mlx_relay.model import sharding, vision  # noqa: E402
from mlx_relay.protocol import relay_pb2 as pb  # noqa: E402

MAX_TOKENS = 12
NUM_LAYERS = 4
QUESTION = "Describe the picture."


def _png(seed: int, size: tuple[int, int] = (40, 32)) -> bytes:
    """A small picture of random colours (not the model's 28x28: the processor resizes)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    return make_tiny_vlm(tmp_path_factory.mktemp("llava"), num_layers=NUM_LAYERS)


@lru_cache(maxsize=2)
def _mlx_vlm(path: str):
    return load_model(Path(path)), load_processor(Path(path))


def _prompt_text(path: Path, images: int, text: str, system: str = "") -> str:
    """The chat as the model's template renders it, images as content parts before the text."""
    _, processor = _mlx_vlm(str(path))
    content = [{"type": "image"}] * images + [{"type": "text", "text": text}]
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": content if images else text})
    return processor.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def _mlx_vlm_inputs(path: Path, images: list[bytes], text: str, system: str = ""):
    _, processor = _mlx_vlm(str(path))
    prompt = _prompt_text(path, len(images), text, system)
    pictures = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    return processor(text=[prompt], images=pictures or None)


def mlx_vlm_tokens(
    path: Path, images: list[bytes], text: str = QUESTION, system: str = ""
) -> list[int]:
    """Single-process mlx-vlm: its processor, its model, its greedy generate_step."""
    model, _ = _mlx_vlm(str(path))
    inputs = _mlx_vlm_inputs(path, images, text, system)
    pixels = mx.array(inputs["pixel_values"]) if images else None
    steps = generate_step(
        mx.array(inputs["input_ids"]), model, pixels, None, max_tokens=MAX_TOKENS, temperature=0.0
    )
    return [int(token) for token, _ in steps]


def _messages(images: list[bytes], text: str = QUESTION, system: str = "") -> list:
    messages = [pb.ChatMessage(role="system", content=system)] if system else []
    return [*messages, pb.ChatMessage(role="user", content=text, images=images)]


def _request(images: list[bytes], text: str = QUESTION, system: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        messages=_messages(images, text, system), params=pb.SamplingParams(max_tokens=MAX_TOKENS)
    )


def test_stages_equal_mlx_vlm(vlm):
    """In process: merged embeddings on rank 0's stage, the decoder cut into stages, greedy
    tokens equal to mlx-vlm's; the stages after rank 0 hold no vision tower."""
    image = _png(1)
    want = mlx_vlm_tokens(vlm, [image])
    encoded = vision.processor_for(str(vlm)).encode(_prompt_text(vlm, 1, QUESTION), [image])
    for split in ([(0, 4)], [(0, 1), (1, 4)], [(0, 3), (3, 4)]):
        shards = [sharding.load_shard(vlm, a, b, has_ends=a == 0) for a, b in split]
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
        assert got == want, f"split {split}"


# 2 ranks prefill in chunks of 6 tokens: an image prompt's embeddings go in slices, one
# of them cutting through the image tokens.
@pytest.fixture(
    scope="module", params=[(1, None, 512), (2, "1,3", 6)], ids=["1rank", "2ranks-chunked"]
)
def vlm_cluster(request, vlm, tmp_path_factory):
    ranks, layers, chunk = request.param
    port = free_ports(1)[0]
    running = start_cluster(
        vlm,
        ranks,
        tmp_path_factory.mktemp("logs"),
        "--http-address",
        f"127.0.0.1:{port}",
        "--prefill-chunk",
        str(chunk),
        layers=layers,
    )
    running.http_base = f"http://127.0.0.1:{port}/v1"
    yield running
    running.stop()


@pytest.mark.cluster
def test_image_chat_equals_mlx_vlm(vlm, vlm_cluster):
    """Two different images at once, then a text-only chat; then the first prompt again
    with another image (same tokens, other pixels: no cache of the first may serve it)."""
    client = vlm_cluster.client
    images = [_png(1), _png(2)]
    results: dict[int, object] = {}

    def run(i: int) -> None:
        try:
            results[i] = list(client.generate(_request([images[i]])).token_ids)
        except Exception as e:  # noqa: BLE001 - reported below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i, image in enumerate(images):
        assert results.get(i) == mlx_vlm_tokens(vlm, [image]), f"image {i}"
    assert results[0] != results[1], "different images give different answers"

    text = list(client.generate(_request([])).token_ids)
    assert text == mlx_vlm_tokens(vlm, [])
    third = _png(3)
    again = list(client.generate(_request([third])).token_ids)
    assert again == mlx_vlm_tokens(vlm, [third])


@pytest.mark.cluster
def test_two_images_and_a_shared_system_prompt(vlm, vlm_cluster):
    """Two images in one message; Tokenize expands both as mlx-vlm's processor does. A
    text chat leaves its caches behind; an image chat sharing its system prompt reuses
    them up to its first image token only, and both give mlx-vlm's tokens."""
    client = vlm_cluster.client
    pair = [_png(5), _png(6, (20, 50))]
    assert list(client.generate(_request(pair)).token_ids) == mlx_vlm_tokens(vlm, pair)
    tokens = client.stub.Tokenize(pb.TokenizeRequest(messages=_messages(pair)), timeout=60)
    expected = _mlx_vlm_inputs(vlm, pair, QUESTION)["input_ids"]
    assert list(tokens.token_ids) == np.asarray(expected).reshape(-1).tolist()

    system = "You are a helpful assistant. " * 4
    text = client.generate(_request([], "Hello!", system))
    assert list(text.token_ids) == mlx_vlm_tokens(vlm, [], "Hello!", system)
    image = _png(7)
    reply = client.generate(_request([image], system=system))
    assert list(reply.token_ids) == mlx_vlm_tokens(vlm, [image], system=system)
    assert reply.usage.cached_tokens > 16, "the system prompt's caches served"


@pytest.mark.cluster
def test_image_tokens_typed_as_text_lend_no_cache_to_an_image(vlm, vlm_cluster):
    """A text chat that spells out the image tokens encodes to exactly the tokens of an
    image chat; its parked caches hold no image, so the image chat must not reuse them."""
    client = vlm_cluster.client
    image = _png(8)
    spelled = "<image>" * 4 + QUESTION
    encoded = _mlx_vlm_inputs(vlm, [image], QUESTION)["input_ids"]
    text = client.generate(_request([], spelled))
    assert list(text.token_ids) == mlx_vlm_tokens(vlm, [], spelled)
    tokens = client.stub.Tokenize(pb.TokenizeRequest(messages=_messages([], spelled)), timeout=60)
    assert list(tokens.token_ids) == np.asarray(encoded).reshape(-1).tolist()
    reply = client.generate(_request([image]))
    assert list(reply.token_ids) == mlx_vlm_tokens(vlm, [image])
    assert reply.usage.cached_tokens == 0


@pytest.mark.cluster
def test_a_file_that_is_no_image_is_invalid_argument(vlm_cluster):
    with pytest.raises(grpc.RpcError) as e:
        vlm_cluster.client.generate(_request([b"not a picture"]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "image 0 is not an image file" in e.value.details()


@pytest.mark.cluster
def test_images_to_a_text_only_model_are_invalid_argument(tiny_model, cluster_factory):
    running = cluster_factory(tiny_model("llama", 2), 1)
    with pytest.raises(grpc.RpcError) as e:
        running.client.generate(_request([_png(1)]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "reads text only" in e.value.details() and "llava" in e.value.details()


@pytest.mark.cluster
def test_openai_image_url_data_urls_reach_the_model(vlm, vlm_cluster):
    """OpenAI's image_url parts with base64 data: URLs give the gRPC door's answer;
    an http(s) URL is refused with a 400 (the server fetches nothing)."""
    client = openai.OpenAI(base_url=vlm_cluster.http_base, api_key="none", max_retries=0)
    image = _png(4)
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    messages = [{"role": "user", "content": content}]
    reply = client.chat.completions.create(
        model=str(vlm), messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    grpc_reply = vlm_cluster.client.generate(_request([image]))
    assert list(grpc_reply.token_ids) == mlx_vlm_tokens(vlm, [image])
    assert reply.choices[0].message.content == grpc_reply.text
    assert reply.usage.completion_tokens == MAX_TOKENS
    content[0]["image_url"]["url"] = "https://example.com/cat.png"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=str(vlm), messages=messages, max_tokens=2)
    assert "data: URLs" in e.value.message
