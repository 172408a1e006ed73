"""Vision-language models: loaded through mlx-vlm, images encoded on rank 0 only.

A VLM here is a vision tower and projector in front of a plain decoder. Rank 0 turns
a prompt with images into input embeddings exactly as mlx-vlm's own model does (text
embeddings with the projected image features spliced in at the image tokens), and the
decoder's layers are split over ranks like any text model's: the workers never see an
image, only hidden states. Only families whose image features merge into the input
embeddings before the first layer are accepted (`VLM_FAMILIES`: llava, gemma3, qwen2_vl,
qwen2_5_vl, gemma4). Qwen2-VL's and Qwen2.5-VL's layers also take multimodal rope positions
(temporal, height, width) that mlx-vlm's own `get_rope_index` computes from the image
grid: rank 0 computes them with the embeddings and sends them with each prefill chunk,
and decode positions are offset + the prompt's rope delta (step_inputs.py). What a family's own forward does to the merged
embeddings before its first layer (gemma3's sqrt(hidden) scale) is done here too, and
its layers keep the caches its language model makes (gemma3's sliding windows).

Gemma 4 (a gemma4 checkpoint with a `vision_config`; one without is text, for mlx-lm)
keeps gemma4_text's split rules (per-layer inputs, KV-shared last layers on the last
rank), run on mlx-vlm's classes. Its image tokens attend to each other both ways
(`use_bidirectional_attention: "vision"`), which mlx-vlm's mask does only in an
unchunked prefill from position 0: such a prompt goes round whole, from position 0
(`prefills_whole`), with its token types as a side array, from which every rank builds
mlx-vlm's own masks (`image_masks`); its per-layer inputs are mlx-vlm's
`get_input_embeddings`' (the image tokens' ids zeroed), projected on rank 0.

mlx-vlm is an optional extra (`pip install 'mlx-relay[vision]'`): it is imported only
when a VLM is loaded or an image request arrives.
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_relay.model import families
from mlx_relay.model.step_inputs import PromptInputs

# model_type -> its decoder families in mlx-vlm (checked by mlx-vlm's LanguageModel).
# (Qwen2-VL's config.json is flat: its text settings at the top, no text_config.)
VLM_FAMILIES = {
    "llava": ("llama", "qwen2"),
    "gemma3": ("gemma3_text",),
    "qwen2_vl": ("qwen2_vl", "qwen2_vl_text"),
    "qwen2_5_vl": ("qwen2_5_vl", "qwen2_5_vl_text"),
    "gemma4": ("gemma4_text",),
}
# Families that are VLMs only where the checkpoint has a vision tower: its config says
# so (vision_config) and its weights hold one (a Gemma 4 converted to text by mlx-lm
# keeps the vision_config, not the tower). Otherwise they are text models, which mlx-lm
# loads (its adapter's `wrappers`: families/gemma4.py).
_TOWER_OPTIONAL = ("gemma4",)
# Families whose language model multiplies its input embeddings, image features merged
# in, by sqrt(hidden_size) rounded to bfloat16 inside its forward (mlx-vlm's gemma3 does;
# its get_input_embeddings divides the image features by the same root beforehand).
SCALED_INPUT_EMBEDDINGS = ("gemma3",)
# Families whose layers take multimodal rope positions, which rank 0 computes with the
# merged embeddings from the image grid (get_rope_index) and sends (step_inputs.py).
MROPE_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
# Modules of a VLM that only rank 0 holds (workers drop them before any weight is read):
# the towers and what projects their features (gemma4: embed_vision, and its audio's).
ENCODER_PARTS = (
    "vision_tower",
    "multi_modal_projector",
    "embed_vision",
    "audio_tower",
    "embed_audio",
)
MAX_IMAGE_BYTES = 20 * 2**20
# What a processor says of the images besides their pixels that get_input_embeddings reads.
IMAGE_EXTRAS = ("image_grid_thw",)


class VisionError(ValueError):
    """An image request this model or this installation cannot serve; says why."""


def encoder_tensor(name: str) -> bool:
    """Whether a checkpoint tensor is the vision tower's or the projector's: rank 0's, like
    the embedding, whatever `layers.N` its name has (the tower's own layers are not the
    language model's). mlx-vlm names them at the top (`vision_tower.`), HF under `model.`."""
    return any(part in ENCODER_PARTS for part in name.split(".")[:2])


def is_vlm(config: dict[str, Any]) -> bool:
    """Whether the model is a vision-language model that mlx-relay loads with mlx-vlm."""
    family = config.get("model_type")
    if family in _TOWER_OPTIONAL and not config.get("vision_config"):
        return False
    return family in VLM_FAMILIES


def text_only(config: dict[str, Any]) -> dict[str, Any]:
    """The config of a checkpoint loaded as a text model: a _TOWER_OPTIONAL family's
    without its vision_config, which names a tower the checkpoint does not hold."""
    if config.get("model_type") not in _TOWER_OPTIONAL:
        return config
    return {k: v for k, v in config.items() if k != "vision_config"}


def prefills_whole(config: dict[str, Any]) -> bool:
    """Whether an image prompt of this (loaded) VLM goes round in one step from position
    0, its token types with it: a model whose image tokens attend to each other (its
    adapter's prefills_images_whole, gemma4's, with `use_bidirectional_attention:
    "vision"`), which mlx-vlm's mask does only in such a prefill (and so mlx-vlm's
    generate prefills such a prompt unchunked)."""
    return (
        is_vlm(config)
        and families.adapter_of(config).prefills_images_whole
        and config.get("use_bidirectional_attention") == "vision"
    )


def _mlx_vlm() -> Any:
    try:
        import mlx_vlm.utils
    except ImportError as e:
        raise VisionError(
            "this is a vision-language model; it needs mlx-vlm "
            "(pip install 'mlx-relay[vision]'): " + str(e)
        ) from e
    return mlx_vlm.utils


def load_vlm(path: Path) -> tuple[nn.Module, dict[str, Any]] | None:
    """The whole VLM, lazily (nothing read yet), and its config with the text model's
    settings (hidden size, context length ...) at the top level as text models have;
    None for a checkpoint of a _TOWER_OPTIONAL family without the tower's weights
    (mlx-vlm drops a module it finds none for), which is a text model."""
    utils = _mlx_vlm()
    model = utils.load_model(Path(path), lazy=True)
    config = dict(utils.load_config(Path(path)))
    if config["model_type"] in _TOWER_OPTIONAL and getattr(model, "vision_tower", None) is None:
        return None
    text = config.get("text_config") or {}
    family = text.get("model_type", config["model_type"])
    allowed = VLM_FAMILIES[config["model_type"]]
    if family not in allowed:
        raise VisionError(
            f"{config['model_type']} with a {family!r} language model is not supported "
            f"(only {', '.join(allowed)})"
        )
    if hasattr(model.language_model, "make_cache"):  # (sliding windows stay windows)
        model.make_cache = functools.partial(_mlx_lm_caches, model.language_model)
    return model, {**text, **{k: v for k, v in config.items() if k != "text_config"}}


def _mlx_lm_caches(language_model: nn.Module) -> list[Any]:
    """The caches the language model makes for itself, as mlx-lm's classes, which the
    stages, batching and prefix reuse know: a sliding-window layer keeps its window."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    out: list[Any] = []
    for cache in language_model.make_cache():
        kind = type(cache).__name__
        if kind == "KVCache":
            out.append(KVCache())
        elif kind == "RotatingKVCache":
            out.append(RotatingKVCache(max_size=cache.max_size, keep=cache.keep))
        else:
            raise VisionError(
                f"its language model keeps a {kind} per layer; mlx-relay splits vision "
                "models with plain or sliding-window KV caches only"
            )
    return out


@dataclass
class Pixels:
    """A request's images preprocessed: the pixel values and whatever else the model's
    processor says of them that its `get_input_embeddings` reads (Qwen2-VL's
    `image_grid_thw`: each image's patch grid, which its positions follow)."""

    values: np.ndarray | list[np.ndarray]  # (a list: images of different sizes, gemma4's)
    extra: dict[str, np.ndarray]


@dataclass
class Encoded:
    """A prompt with images, as the model sees it: image tokens expanded, pixels ready."""

    token_ids: list[int]
    pixel_values: Pixels


class ImageProcessor:
    """mlx-vlm's processor for one model dir: prompt text plus images to tokens and pixels."""

    def __init__(self, path: str) -> None:
        self.processor = _mlx_vlm().load_processor(path, add_detokenizer=False)

    def encode(self, text: str, images: list[bytes]) -> Encoded:
        """Expand each image placeholder of `text` and preprocess `images` (file bytes)
        with the model's processor, as mlx-vlm's generate does."""
        pictures = [decode_image(i, data) for i, data in enumerate(images)]
        try:  # (its kwargs go to the image processor too, which refuses tokenizer ones)
            out = self.processor(text=[text], images=pictures)
        except Exception as e:  # noqa: BLE001 - the processor's reasons are the client's
            raise VisionError(f"the model's image processor refused the request: {e}") from e
        ids = [int(t) for t in np.asarray(out["input_ids"]).reshape(-1).tolist()]
        # mlx-lm's rule for text prompts: no BOS added when the template wrote one.
        tokenizer = getattr(self.processor, "tokenizer", None)
        bos = getattr(tokenizer, "bos_token_id", None)
        if bos is not None and ids[:2] == [bos, bos]:
            ids = ids[1:]
        extra = {k: np.asarray(out[k]) for k in IMAGE_EXTRAS if k in out}
        values = out["pixel_values"]
        if isinstance(values, list):  # (one array an image, each its own size)
            return Encoded(ids, Pixels([np.asarray(v) for v in values], extra))
        return Encoded(ids, Pixels(np.asarray(values), extra))


class MessageParts:
    """A message's text and images in the order a client gave them, as the gRPC message
    carries them: the text joined, each image with its offset in that text."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.images: list[bytes] = []
        self.offsets: list[int] = []
        self._length = 0

    def text(self, text: str) -> None:
        self.texts.append(text)
        self._length += len(text)

    def image(self, data: bytes) -> None:
        self.images.append(data)
        self.offsets.append(self._length)

    def fields(self) -> dict[str, Any]:
        """`pb.ChatMessage` fields: content, images, image_offsets (left empty when every
        image comes first, which is what no offsets mean)."""
        at = self.offsets if any(self.offsets) else []
        return {"content": "".join(self.texts), "images": self.images, "image_offsets": at}


def content_parts(content: str, images: int, offsets: list[int]) -> list[dict[str, Any]]:
    """A message's text and `images` image placeholders as OpenAI-style content parts,
    in order (no offsets: the images first), as vision models' chat templates read them."""
    if offsets and len(offsets) != images:
        raise VisionError(f"image_offsets has {len(offsets)} entries for {images} image(s)")
    at = list(offsets) or [0] * images
    if at != sorted(at) or (at and at[-1] > len(content)):
        raise VisionError(
            f"image_offsets {at} must never decrease and stay within the content's "
            f"{len(content)} characters"
        )
    parts: list[dict[str, Any]] = []
    start = 0
    for offset in at:
        if offset > start:
            parts.append({"type": "text", "text": content[start:offset]})
            start = offset
        parts.append({"type": "image"})
    if start < len(content):
        parts.append({"type": "text", "text": content[start:]})
    return parts


def b64decode_image(data: str, where: str) -> bytes:
    """An image sent as base64 text (a `data:...;base64,` prefix allowed) to its bytes."""
    head, comma, rest = data.partition(",")
    if data.startswith("data:") and comma:
        if not head.endswith(";base64"):
            raise VisionError(f"{where}: a data: URL must be base64 (data:image/png;base64,...)")
        data = rest
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise VisionError(f"{where}: the image is not valid base64 ({e})") from None


@functools.lru_cache(maxsize=2)
def processor_for(path: str) -> ImageProcessor:
    return ImageProcessor(path)


def decode_image(i: int, data: bytes) -> Any:
    """File bytes (PNG, JPEG, ...) to an RGB PIL image, or VisionError naming the image."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise VisionError(f"image {i} is empty")
    if len(data) > MAX_IMAGE_BYTES:
        raise VisionError(f"image {i} is {len(data)} bytes, at most {MAX_IMAGE_BYTES}")
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError) as e:
        raise VisionError(f"image {i} is not an image file PIL can read: {e}") from None
    return image.convert("RGB")


def image_token_id(config: dict[str, Any]) -> int:
    return int(config.get("image_token_index", config.get("image_token_id", -1)))


def prompt_inputs(model: nn.Module, token_ids: list[int], pixels: Pixels) -> PromptInputs:
    """The merged input embeddings (1, len(token_ids), hidden) of a prompt with images,
    computed by the model's own mlx-vlm code (vision tower, projector, splice), and for
    a multimodal-rope family its positions (3, 1, len) and rope delta, from the same call
    (its get_rope_index on the image grids)."""
    ids = mx.array([token_ids])
    # (the attention mask of the prompt, all of it, as mlx-vlm's generate passes it)
    extra = {k: mx.array(v) for k, v in pixels.extra.items()}
    features = model.get_input_embeddings(
        ids, _mx_pixels(pixels.values), mask=mx.ones_like(ids), **extra
    )
    h = features.inputs_embeds
    family = model.config.model_type
    if family in SCALED_INPUT_EMBEDDINGS:  # what its forward does first
        hidden = model.language_model.config.hidden_size
        h = h * mx.array(hidden**0.5, mx.bfloat16).astype(h.dtype)
    if family not in MROPE_FAMILIES:
        # gemma4: the per-layer inputs of the ids with the image tokens' zeroed, and
        # which tokens are an image's, for its mask (image_masks)
        types = None
        if getattr(model.language_model.config, "use_bidirectional_attention", None) == "vision":
            types = (ids == model.config.image_token_id).astype(mx.int32)
        return PromptInputs(h, per_layer=features.per_layer_inputs, token_types=types)
    delta = int(features.rope_deltas.reshape(-1)[0].item())
    return PromptInputs(h, features.position_ids, delta)


def _mx_pixels(values: np.ndarray | list[np.ndarray]) -> mx.array | list[mx.array]:
    return [mx.array(v) for v in values] if isinstance(values, list) else mx.array(values)


def image_masks(
    inner: nn.Module, h: mx.array, caches: list[Any], token_types: mx.array
) -> list[Any]:
    """The masks of a shard's layers (`inner`: its mlx-vlm decoder) for an image prompt's
    prefill from position 0, by mlx-vlm's own gemma4 code: causal (within the window)
    and each image's tokens seeing all that image's. `caches`: the layers' own, in order
    (its KV-shared layers, last, have none; their masks are their kind's)."""
    padded = list(caches) + [None] * (len(inner.layers) - len(caches))
    return inner._make_masks(h, padded, token_types)
