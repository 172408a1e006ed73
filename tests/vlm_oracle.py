"""The vision tests' oracle: single-process mlx-vlm, and a model's stages run in process.

Every vision family's tests check the same two things against mlx-vlm's own processor,
model and greedy `generate_step`: tokens from the ranks' stages cut in one process, and
tokens from a real cluster.
"""

from __future__ import annotations

import io
from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_vlm.generate.ar import generate_step
from mlx_vlm.utils import load_model, load_processor
from PIL import Image
from staged import Staged

from mlx_relay.model import vision
from mlx_relay.protocol import relay_pb2 as pb

MAX_TOKENS = 12
QUESTION = "Describe the picture."


def png(seed: int, size: tuple[int, int] = (40, 32)) -> bytes:
    """A small picture of random colours (not the model's own size: the processor resizes)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def image_request(images: list[bytes], text: str = QUESTION) -> pb.GenerateRequest:
    """A one-message greedy chat with these images, MAX_TOKENS long."""
    return pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content=text, images=images)],
        params=pb.SamplingParams(max_tokens=MAX_TOKENS),
    )


def checkpoint_weights(path: Path) -> dict[str, mx.array]:
    """Every tensor of a tiny checkpoint, by name."""
    weights: dict[str, mx.array] = {}
    for f in path.glob("*.safetensors"):
        weights.update(mx.load(str(f)))
    return weights


def layer_bytes(weights: dict[str, mx.array], num_layers: int) -> list[int]:
    """Each language-model layer's bytes, as mlx-vlm names them."""
    return [
        sum(
            a.nbytes
            for k, a in weights.items()
            if k.startswith(f"language_model.model.layers.{i}.")
        )
        for i in range(num_layers)
    ]


@lru_cache(maxsize=4)
def loaded(path: str):
    """mlx-vlm's model and processor for `path`, loaded once."""
    return load_model(Path(path)), load_processor(Path(path))


def prompt_text(path: Path, images: int, text: str = QUESTION, system: str = "") -> str:
    """The chat as the model's template renders it, images as content parts before the text."""
    _, processor = loaded(str(path))
    content = [{"type": "image"}] * images + [{"type": "text", "text": text}]
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": content if images else text})
    return processor.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def inputs(path: Path, images: list[bytes], text: str = QUESTION, system: str = ""):
    """mlx-vlm's processor output for the chat: input ids, pixel values, attention mask."""
    _, processor = loaded(str(path))
    prompt = prompt_text(path, len(images), text, system)
    pictures = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    return processor(text=[prompt], images=pictures or None)


def mlx_vlm_tokens(
    path: Path, images: list[bytes], text: str = QUESTION, system: str = "", encoded=None
) -> list[int]:
    """Single-process mlx-vlm: its processor, its model and caches, its greedy decoding."""
    model, _ = loaded(str(path))
    encoded = encoded or inputs(path, images, text, system)
    pixels = encoded["pixel_values"] if images else None
    if isinstance(pixels, list):  # (images of different sizes: gemma4's processor)
        pixels = [mx.array(p) for p in pixels]
    elif pixels is not None:
        pixels = mx.array(pixels)
    mask = mx.array(encoded["attention_mask"]) if "attention_mask" in encoded else None
    # (what else the processor says of the images: Qwen2-VL's image grids, Gemma 4's
    # token types, which mlx-vlm's generate passes on as its model's own keywords)
    keys = (*vision.IMAGE_EXTRAS, "mm_token_type_ids")
    extra = {k: mx.array(encoded[k]) for k in keys if k in encoded and images}
    steps = generate_step(
        mx.array(encoded["input_ids"]),
        model,
        pixels,
        mask,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        **extra,
    )
    return [int(token) for token, _ in steps]


def staged_tokens(
    path: Path,
    image: bytes | list[bytes],
    prompt: str,
    ranges: list[tuple[int, int]],
    chunk: int = 0,
) -> list[int]:
    """Greedy tokens of the model cut into `ranges` in one process, run by the ranks' own
    code (tests/staged.py): rank 0's merged image embeddings (and, for a multimodal-rope
    model, its positions as a side array and its rope delta in every header; for gemma4
    its per-layer inputs and, with the prompt, its token types), prefill chunks of
    `chunk` tokens (0: the whole prompt); the stages after rank 0 hold no vision tower."""
    images = image if isinstance(image, list) else [image]
    encoded = vision.processor_for(str(path)).encode(prompt, images)
    staged = Staged(path, ranges)
    shards = staged.shards
    assert all(not any(p in s.model for p in vision.ENCODER_PARTS) for s in shards[1:])
    prompt_in = vision.prompt_inputs(shards[0].model, encoded.token_ids, encoded.pixel_values)
    size = len(encoded.token_ids)
    slot, position, logits = 3, 0, None
    while position < size:
        n = min(chunk or size, size - position)
        ids = mx.array([encoded.token_ids[position : position + n]])
        logits = staged.logits(slot, position, ids, prompt_in.chunk(position, n))
        position += n
    got = []
    for _ in range(MAX_TOKENS):
        token = int(mx.argmax(logits, axis=-1).item())
        got.append(token)
        logits = staged.logits(slot, position, mx.array([[token]]), decode=True)
        position += 1
    return got
