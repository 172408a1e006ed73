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
from pathlib import Path

import anthropic
import grpc
import httpx
import numpy as np
import openai
import pytest

pytest.importorskip("mlx_vlm", reason="the vision extra (mlx-vlm) is not installed")

from conftest import start_cluster  # noqa: E402
from mlx_vlm.prompt_utils import apply_chat_template  # noqa: E402
from mlx_vlm.utils import load_config  # noqa: E402
from PIL import Image  # noqa: E402
from tiny_models import make_tiny_vlm  # noqa: E402
from vlm_oracle import (  # noqa: E402
    MAX_TOKENS,
    QUESTION,
    checkpoint_weights,
    inputs,
    layer_bytes,
    loaded,
    mlx_vlm_tokens,
    png,
    prompt_text,
    staged_tokens,
)

from mlx_relay.launch.local import free_ports  # noqa: E402
from mlx_relay.model import memory, sharding, split  # noqa: E402
from mlx_relay.model.prefix_store import BLOCK_TOKENS  # noqa: E402
from mlx_relay.protocol import relay_pb2 as pb  # noqa: E402
from mlx_relay.protocol.localai import backend_pb2 as lpb  # noqa: E402
from mlx_relay.protocol.localai import backend_pb2_grpc as lpb_grpc  # noqa: E402

NUM_LAYERS = 4


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    return make_tiny_vlm(tmp_path_factory.mktemp("llava"), num_layers=NUM_LAYERS)


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
    image = png(1)
    want = mlx_vlm_tokens(vlm, [image])
    for ranges in ([(0, 4)], [(0, 1), (1, 4)], [(0, 3), (3, 4)]):
        got = staged_tokens(vlm, image, prompt_text(vlm, 1), ranges)
        assert got == want, f"split {ranges}"


def test_the_vision_tower_is_rank_0s_in_the_byte_counts(vlm):
    """The tower's own `layers.N` are not the language model's layers: the memory check
    (shard_nbytes) and the split by bytes (layer_costs) give each layer the language
    model's bytes only, and the tower and projector to rank 0, with the embedding."""
    weights = checkpoint_weights(vlm)
    assert any(k.startswith("vision_tower.") and ".layers.0." in k for k in weights)

    def nbytes(prefix: str | tuple[str, ...]) -> int:
        return sum(a.nbytes for k, a in weights.items() if k.startswith(prefix))

    layer = layer_bytes(weights, NUM_LAYERS)
    encoder = nbytes(("vision_tower.", "multi_modal_projector."))
    total = nbytes("")
    rank0_rest = total - sum(layer)  # embedding, norm, head, tower, projector
    assert encoder > 0 and rank0_rest > encoder

    costs = split.layer_costs(vlm, NUM_LAYERS, sharding.read_config(vlm))
    assert costs is not None and costs.held == layer
    assert costs.ends == rank0_rest
    for start, end in [(0, 1), (1, 3), (0, 4)]:
        assert memory.shard_nbytes(vlm, start, end) == sum(layer[start:end])
    ranks = [memory.shard_nbytes(vlm, a, b, ends=a == 0) for a, b in [(0, 1), (1, 3), (3, 4)]]
    assert ranks[0] == layer[0] + rank0_rest
    assert sum(ranks) == total


# 2 ranks prefill in chunks of 6 tokens: an image prompt's embeddings go in slices, one
# of them cutting through the image tokens.
@pytest.fixture(
    scope="module", params=[(1, None, 512), (2, "1,3", 6)], ids=["1rank", "2ranks-chunked"]
)
def vlm_cluster(request, vlm, tmp_path_factory):
    ranks, layers, chunk = request.param
    port, localai_port = free_ports(2)
    running = start_cluster(
        vlm,
        ranks,
        tmp_path_factory.mktemp("logs"),
        "--http-address",
        f"127.0.0.1:{port}",
        "--localai-address",
        f"127.0.0.1:{localai_port}",
        "--prefill-chunk",
        str(chunk),
        layers=layers,
    )
    running.http_root = f"http://127.0.0.1:{port}"
    running.http_base = running.http_root + "/v1"
    running.localai = f"127.0.0.1:{localai_port}"
    yield running
    running.stop()


@pytest.mark.cluster
def test_image_chat_equals_mlx_vlm(vlm, vlm_cluster):
    """Two different images at once, then a text-only chat; then the first prompt again
    with another image (same tokens, other pixels: no cache of the first may serve it)."""
    client = vlm_cluster.client
    images = [png(1), png(2)]
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
    third = png(3)
    again = list(client.generate(_request([third])).token_ids)
    assert again == mlx_vlm_tokens(vlm, [third])


@pytest.mark.cluster
def test_two_images_and_a_shared_system_prompt(vlm, vlm_cluster):
    """Two images in one message; Tokenize expands both as mlx-vlm's processor does. A
    text chat leaves its caches behind; an image chat sharing its system prompt reuses
    them up to its first image token only, and both give mlx-vlm's tokens."""
    client = vlm_cluster.client
    pair = [png(5), png(6, (20, 50))]
    assert list(client.generate(_request(pair)).token_ids) == mlx_vlm_tokens(vlm, pair)
    tokens = client.stub.Tokenize(pb.TokenizeRequest(messages=_messages(pair)), timeout=60)
    expected = inputs(vlm, pair, QUESTION)["input_ids"]
    assert list(tokens.token_ids) == np.asarray(expected).reshape(-1).tolist()

    system = "You are a helpful assistant. " * 4
    text = client.generate(_request([], "Hello!", system))
    assert list(text.token_ids) == mlx_vlm_tokens(vlm, [], "Hello!", system)
    image = png(7)
    reply = client.generate(_request([image], system=system))
    assert list(reply.token_ids) == mlx_vlm_tokens(vlm, [image], system=system)
    assert reply.usage.cached_tokens > 16, "the system prompt's caches served"


@pytest.mark.cluster
def test_image_tokens_typed_as_text_lend_no_cache_to_an_image(vlm, vlm_cluster):
    """A text chat that spells out the image tokens encodes to exactly the tokens of an
    image chat; its parked caches hold no image, so the image chat must not reuse them."""
    client = vlm_cluster.client
    image = png(8)
    spelled = "<image>" * 4 + QUESTION
    encoded = inputs(vlm, [image], QUESTION)["input_ids"]
    text = client.generate(_request([], spelled))
    assert list(text.token_ids) == mlx_vlm_tokens(vlm, [], spelled)
    tokens = client.stub.Tokenize(pb.TokenizeRequest(messages=_messages([], spelled)), timeout=60)
    assert list(tokens.token_ids) == np.asarray(encoded).reshape(-1).tolist()
    reply = client.generate(_request([image]))
    assert list(reply.token_ids) == mlx_vlm_tokens(vlm, [image])
    assert reply.usage.cached_tokens == 0


@pytest.mark.cluster
def test_image_chats_reuse_the_caches_of_the_same_images_only(vlm, vlm_cluster):
    """Image prompts' caches are kept under their images' contents (image_keys.py): the
    same image chat again reuses all of its prompt but the last token; another question
    about the same image reuses the system prompt and the image; the same words with
    another image reuse only what comes before the image. Every answer is mlx-vlm's."""
    client = vlm_cluster.client
    system, question = "You answer in one word. " * 3, "What colour is it?"
    image, other = png(11), png(12)
    first = client.generate(_request([image], system=system))
    assert list(first.token_ids) == mlx_vlm_tokens(vlm, [image], system=system)
    again = client.generate(_request([image], system=system))
    assert list(again.token_ids) == list(first.token_ids)
    assert again.usage.cached_tokens == first.usage.prompt_tokens - 1

    messages = _messages([image], question, system)
    prompt = list(client.stub.Tokenize(pb.TokenizeRequest(messages=messages), timeout=60).token_ids)
    image_token = int(load_config(vlm)["image_token_index"])
    first_image = prompt.index(image_token)
    after_image = len(prompt) - prompt[::-1].index(image_token)
    asked = client.generate(_request([image], question, system))
    assert list(asked.token_ids) == mlx_vlm_tokens(vlm, [image], question, system)
    assert asked.usage.cached_tokens >= after_image > first_image > 16
    swapped = client.generate(_request([other], question, system))
    assert list(swapped.token_ids) == mlx_vlm_tokens(vlm, [other], question, system)
    assert 16 <= swapped.usage.cached_tokens <= first_image


@pytest.mark.cluster
def test_image_chats_restore_stored_blocks_of_the_same_images_only(vlm, tmp_path):
    """With --prompt-cache-dir an image prompt's blocks are stored under its image-keyed
    tokens: pushed out of the one slot, the same image chat loads its whole blocks from
    disk; the same words with another image load only the blocks before the image."""
    store = tmp_path / "store"
    running = start_cluster(
        vlm, 2, tmp_path / "logs", "--prompt-cache-dir", str(store), "--max-active", "1"
    )
    try:
        client = running.client
        system = "You answer in one word, and only about the picture. " * 12
        image, other = png(13), png(14)
        first = client.generate(_request([image], system=system))
        assert list(first.token_ids) == mlx_vlm_tokens(vlm, [image], system=system)
        client.generate(_request([], "Hello!"))  # (the one slot: the image chat leaves RAM)
        again = client.generate(_request([image], system=system))
        assert list(again.token_ids) == list(first.token_ids)
        whole = (first.usage.prompt_tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS
        assert again.usage.cached_tokens == whole > 0
        client.generate(_request([], "Hello!"))
        swapped = client.generate(_request([other], system=system))
        assert list(swapped.token_ids) == mlx_vlm_tokens(vlm, [other], system=system)
        messages = _messages([image], QUESTION, system)
        prompt = client.stub.Tokenize(pb.TokenizeRequest(messages=messages), timeout=60).token_ids
        first_image = list(prompt).index(int(load_config(vlm)["image_token_index"]))
        assert swapped.usage.cached_tokens == first_image // BLOCK_TOKENS * BLOCK_TOKENS > 0
    finally:
        running.stop()


@pytest.mark.cluster
def test_a_file_that_is_no_image_is_invalid_argument(vlm_cluster):
    with pytest.raises(grpc.RpcError) as e:
        vlm_cluster.client.generate(_request([b"not a picture"]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "image 0 is not an image file" in e.value.details()


@pytest.mark.cluster
def test_images_to_a_text_only_model_are_invalid_argument(tiny_model, cluster_factory):
    """Every door refuses an image to a text-only model as a bad request that says why:
    gRPC, OpenAI (chat and Responses), Anthropic, Ollama (chat and generate) and LocalAI."""
    model = tiny_model("llama", 2)
    port, localai_port = free_ports(2)
    running = cluster_factory(
        model,
        1,
        "--http-address",
        f"127.0.0.1:{port}",
        "--localai-address",
        f"127.0.0.1:{localai_port}",
    )
    with pytest.raises(grpc.RpcError) as e:
        running.client.generate(_request([png(1)]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "reads text only" in e.value.details() and "llava" in e.value.details()

    image = _b64(png(1))
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
        bodies = {
            "/v1/chat/completions": {
                "messages": [{"role": "user", "content": [_openai_part(png(1))]}],
            },
            "/v1/messages": {
                "max_tokens": 2,
                "messages": [{"role": "user", "content": [_anthropic_block(png(1))]}],
            },
            "/api/chat": {"messages": [{"role": "user", "content": "Hi", "images": [image]}]},
            "/api/generate": {"prompt": "Hi", "images": [image]},
        }
        for path, body in bodies.items():
            answer = http.post(path, json={"model": str(model), "stream": False, **body})
            assert answer.status_code == 400, (path, answer.text)
            assert "reads text only" in answer.text, (path, answer.text)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model=str(model), input=[_responses_message([png(1), "Hi"])], max_output_tokens=2
        )
    assert "reads text only" in e.value.message and "llava" in e.value.message
    with grpc.insecure_channel(f"127.0.0.1:{localai_port}") as channel:
        options = lpb.PredictOptions(Prompt="Hi", Images=[image])
        with pytest.raises(grpc.RpcError) as e:
            lpb_grpc.BackendStub(channel).Predict(options, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "reads text only" in e.value.details()


@pytest.mark.cluster
def test_openai_image_url_data_urls_reach_the_model(vlm, vlm_cluster):
    """OpenAI's image_url parts with base64 data: URLs give the gRPC door's answer;
    an http(s) URL is refused with a 400 (the server fetches nothing)."""
    client = openai.OpenAI(base_url=vlm_cluster.http_base, api_key="none", max_retries=0)
    image = png(4)
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


def _b64(image: bytes) -> str:
    return base64.b64encode(image).decode()


def _openai_part(part: str | bytes) -> dict:
    if isinstance(part, bytes):
        return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + _b64(part)}}
    return {"type": "text", "text": part}


def _responses_message(parts: list[str | bytes]) -> dict:
    """A Responses API user message of `parts`: input_text, input_image (a data: URL)."""
    content = [
        {"type": "input_image", "image_url": "data:image/png;base64," + _b64(p), "detail": "auto"}
        if isinstance(p, bytes)
        else {"type": "input_text", "text": p}
        for p in parts
    ]
    return {"type": "message", "role": "user", "content": content}


def _anthropic_block(part: str | bytes) -> dict:
    if isinstance(part, bytes):
        source = {"type": "base64", "media_type": "image/png", "data": _b64(part)}
        return {"type": "image", "source": source}
    return {"type": "text", "text": part}


def _openai_text(cluster, vlm: Path, parts: list[str | bytes]) -> str:
    """The OpenAI door's greedy answer to one user message of `parts` (text or image)."""
    client = openai.OpenAI(base_url=cluster.http_base, api_key="none", max_retries=0)
    reply = client.chat.completions.create(
        model=str(vlm),
        messages=[{"role": "user", "content": [_openai_part(p) for p in parts]}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert reply.usage.completion_tokens == MAX_TOKENS
    return reply.choices[0].message.content


@pytest.mark.cluster
def test_anthropic_image_blocks_equal_the_openai_door(vlm, vlm_cluster):
    """Anthropic's base64 image blocks, through its SDK, give the OpenAI door's answer for
    the same image and text; a url source is refused with a 400 that says why."""
    image = png(9)
    want = _openai_text(vlm_cluster, vlm, [image, QUESTION])
    client = anthropic.Anthropic(base_url=vlm_cluster.http_root, api_key="none", max_retries=0)
    content = [_anthropic_block(image), _anthropic_block(QUESTION)]
    reply = client.messages.create(
        model=str(vlm),
        max_tokens=MAX_TOKENS,  # (greedy: the server's default temperature is 0)
        messages=[{"role": "user", "content": content}],
    )
    assert reply.content[0].text == want
    assert reply.usage.output_tokens == MAX_TOKENS
    content[0]["source"] = {"type": "url", "url": "https://example.com/cat.png"}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model=str(vlm), max_tokens=2, messages=[{"role": "user", "content": content}]
        )
    said = e.value.body["error"]["message"]
    assert "only base64 image sources" in said and "not 'url'" in said, said


@pytest.mark.cluster
def test_responses_input_images_equal_the_openai_door(vlm, vlm_cluster):
    """The Responses API's input_image parts (base64 data: URLs), through the SDK, streamed
    and not, give the chat door's answer for the same parts, an image between two texts
    kept in its place; an http(s) URL or a file_id is refused with a 400 that says why."""
    client = openai.OpenAI(base_url=vlm_cluster.http_base, api_key="none", max_retries=0)
    image = png(13)
    between = [BETWEEN[0], image, BETWEEN[1]]
    wants = [_openai_text(vlm_cluster, vlm, p) for p in ([image, QUESTION], between)]
    first = _openai_text(vlm_cluster, vlm, [image, "".join(BETWEEN)])
    assert wants[1] != first, "the image's place matters"
    for parts, want in zip(([image, QUESTION], between), wants, strict=True):
        asked = {
            "model": str(vlm),
            "input": [_responses_message(parts)],
            "max_output_tokens": MAX_TOKENS,
            "temperature": 0,
        }
        reply = client.responses.create(**asked)
        assert reply.output_text == want
        assert reply.usage.output_tokens == MAX_TOKENS
        events = list(client.responses.create(**asked, stream=True))
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == want
        assert events[-1].type == "response.incomplete"  # (stopped at max_output_tokens)
        assert events[-1].response.output_text == want

    message = _responses_message([image, QUESTION])
    message["content"][0]["image_url"] = "https://example.com/cat.png"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=str(vlm), input=[message], max_output_tokens=2)
    assert "input[0].content[0].image_url" in e.value.message
    assert "data: URLs" in e.value.message and "does not fetch" in e.value.message
    message["content"][0] = {"type": "input_image", "file_id": "file-123", "detail": "auto"}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=str(vlm), input=[message], max_output_tokens=2)
    assert "data: URL" in e.value.message and "file_id is not accepted" in e.value.message


@pytest.mark.cluster
def test_ollama_images_equal_the_openai_door(vlm, vlm_cluster):
    """Ollama's `images` (base64 strings, shown before the text) on a chat message and on
    generate give the OpenAI door's answer; bad base64 is a 400 naming the image."""
    image = png(10)
    want = _openai_text(vlm_cluster, vlm, [image, QUESTION])
    options = {"temperature": 0, "num_predict": MAX_TOKENS}
    with httpx.Client(base_url=vlm_cluster.http_root, timeout=120) as http:
        message = {"role": "user", "content": QUESTION, "images": [_b64(image)]}
        chat = http.post(
            "/api/chat",
            json={"model": str(vlm), "messages": [message], "stream": False, "options": options},
        )
        assert chat.status_code == 200, chat.text
        assert chat.json()["message"]["content"] == want
        generate = http.post(
            "/api/generate",
            json={
                "model": str(vlm),
                "prompt": QUESTION,
                "images": [_b64(image)],
                "stream": False,
                "options": options,
            },
        )
        assert generate.status_code == 200, generate.text
        assert generate.json()["response"] == want
        message["images"] = ["not base64!"]
        bad = http.post("/api/chat", json={"model": str(vlm), "messages": [message]})
        assert bad.status_code == 400
        assert "messages[0].images[0]" in bad.text and "base64" in bad.text


@pytest.mark.cluster
def test_localai_images_equal_the_openai_door(vlm, vlm_cluster):
    """LocalAI's `PredictOptions.Images` (base64) are shown with the last user message,
    as LocalAI's own mlx-vlm backend shows them: the OpenAI door's answer, streamed or not."""
    image = png(11)
    want = _openai_text(vlm_cluster, vlm, [image, QUESTION])
    options = lpb.PredictOptions(
        Messages=[lpb.Message(role="user", content=QUESTION)],
        UseTokenizerTemplate=True,
        Images=[_b64(image)],
        Tokens=MAX_TOKENS,
        Temperature=0,
    )
    with grpc.insecure_channel(vlm_cluster.localai) as channel:
        stub = lpb_grpc.BackendStub(channel)
        reply = stub.Predict(options, timeout=120)
        assert reply.message.decode() == want
        assert reply.tokens == MAX_TOKENS
        streamed = b"".join(r.message for r in stub.PredictStream(options, timeout=120))
        assert streamed.decode() == want
        options.Images[:] = ["%%%"]
        with pytest.raises(grpc.RpcError) as e:
            stub.Predict(options, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "Images[0]" in e.value.details()


# An image between two pieces of text, as a client wrote the message.
BETWEEN = ["Look at this: ", "How many colours are in it?"]


@pytest.mark.cluster
def test_an_image_between_texts_stays_there(vlm, vlm_cluster):
    """[text, image, text] renders in that order (mlx-vlm's llava prompt helper keeps the
    order too): gRPC's image_offsets give mlx-vlm's tokens for the same parts, and the
    OpenAI and Anthropic doors place the image the same way."""
    image = png(12)
    _, processor = loaded(str(vlm))
    content = [{"type": "text", "text": BETWEEN[0]}, {"type": "image"}]
    content.append({"type": "text", "text": BETWEEN[1]})
    prompt = apply_chat_template(
        processor, load_config(vlm), [{"role": "user", "content": content}], num_images=1
    )
    assert prompt.index(BETWEEN[0]) < prompt.index("<image>") < prompt.index(BETWEEN[1])
    picture = Image.open(io.BytesIO(image)).convert("RGB")
    want = mlx_vlm_tokens(vlm, [image], encoded=processor(text=[prompt], images=[picture]))

    message = pb.ChatMessage(
        role="user", content="".join(BETWEEN), images=[image], image_offsets=[len(BETWEEN[0])]
    )
    request = pb.GenerateRequest(
        messages=[message],
        params=pb.SamplingParams(max_tokens=MAX_TOKENS),
        chat_template_kwargs_json='{"enable_thinking": false}',  # mlx-vlm's default
    )
    reply = vlm_cluster.client.generate(request)
    assert list(reply.token_ids) == want
    first = pb.ChatMessage(role="user", content="".join(BETWEEN), images=[image])
    request.messages[0].CopyFrom(first)
    assert list(vlm_cluster.client.generate(request).token_ids) != want, "the place matters"

    parts = [BETWEEN[0], image, BETWEEN[1]]
    text = _openai_text(vlm_cluster, vlm, parts)
    request.messages[0].CopyFrom(message)
    request.ClearField("chat_template_kwargs_json")
    assert text == vlm_cluster.client.generate(request).text
    client = anthropic.Anthropic(base_url=vlm_cluster.http_root, api_key="none", max_retries=0)
    answer = client.messages.create(
        model=str(vlm),
        max_tokens=MAX_TOKENS,  # (greedy: the server's default temperature is 0)
        messages=[{"role": "user", "content": [_anthropic_block(p) for p in parts]}],
    )
    assert answer.content[0].text == text


@pytest.mark.cluster
def test_image_offsets_that_do_not_fit_are_invalid_argument(vlm_cluster):
    message = pb.ChatMessage(role="user", content="Hi", images=[png(1)], image_offsets=[5])
    with pytest.raises(grpc.RpcError) as e:
        vlm_cluster.client.generate(pb.GenerateRequest(messages=[message]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages[0].image_offsets" in e.value.details()
