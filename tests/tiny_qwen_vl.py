"""Tiny random-weight Qwen2-VL and Qwen2.5-VL models (mlx-vlm's layout) made at test time.

Each is the text models' tokenizer plus Qwen's vision markers, a 2-block vision tower
(14-pixel patches, 2x2 merged into one image token; images of 56x84 pixels become 6
image tokens on a 2x3 grid, whose multimodal rope positions differ from a plain count),
a 4-layer Qwen2 decoder with multimodal rope sections, and the processor's config.
"""

from __future__ import annotations

import json
import pathlib

import mlx.core as mx
from mlx.utils import tree_flatten
from tiny_models import CHAT_TEMPLATE, _config, _init_weights, add_special_tokens, write_tokenizer

VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
QWEN_VL_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
PATCH, MERGE = 14, 2
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112

TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- for part in content if part.type == 'text' %}{{- part.text }}{%- endfor %}",
    "{%- for part in content %}{%- if part.type in ('image', 'image_url') %}"
    "{{- '" + VISION_START + IMAGE_PAD + VISION_END + "' }}"
    "{%- elif part.type == 'text' %}{{- part.text }}{%- endif %}{%- endfor %}",
)
assert TEMPLATE != CHAT_TEMPLATE


def _vision_config(family: str, hidden: int) -> dict:
    common = {
        "model_type": family,
        "depth": 2,
        "num_heads": 2,
        "patch_size": PATCH,
        "spatial_patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": 2,
        "in_channels": 3,
    }
    if family == "qwen2_vl":  # the merger projects to the text model's width
        return {**common, "embed_dim": 32, "hidden_size": hidden, "mlp_ratio": 2}
    return {
        **common,
        "hidden_size": 32,
        "intermediate_size": 64,
        "out_hidden_size": hidden,
        "window_size": 56,
        "fullatt_block_indexes": [1],
    }


def make_tiny_qwen_vl(
    path: pathlib.Path, family: str, *, num_layers: int = 4, hidden_size: int = 64, seed: int = 0
) -> pathlib.Path:
    """Write a tiny random `family` (qwen2_vl or qwen2_5_vl) VLM into `path`; return it."""
    if family == "qwen2_vl":
        from mlx_vlm.models import qwen2_vl as module
    else:
        from mlx_vlm.models import qwen2_5_vl as module
    path = write_tokenizer(path)
    ids = add_special_tokens(path, (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD), TEMPLATE)
    text = _config("qwen2", num_layers, hidden_size, family == "qwen2_5_vl", None, None)
    head_dim = text.pop("head_dim")
    text.update(
        model_type=family,
        vocab_size=ids[VIDEO_PAD] + 1,
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},  # head_dim 16: 8 freqs
    )
    assert head_dim == 16
    config = {  # flat, as Qwen2-VL's own config.json: the text settings at the top
        **text,
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "bos_token_id": text["pad_token_id"],  # (no BOS; transformers' default is Qwen's id)
        "image_token_id": ids[IMAGE_PAD],
        "video_token_id": ids[VIDEO_PAD],
        "vision_start_token_id": ids[VISION_START],
        "vision_end_token_id": ids[VISION_END],
        "vision_config": _vision_config(family, hidden_size),
    }
    model_config = module.ModelConfig.from_dict(dict(config))
    model_config.text_config = module.TextConfig.from_dict(text)
    model_config.vision_config = module.VisionConfig.from_dict(config["vision_config"])
    model = module.Model(model_config)
    _init_weights(model, seed, gemma=False)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    processor_class = "Qwen2VLProcessor" if family == "qwen2_vl" else "Qwen2_5_VLProcessor"
    processor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": processor_class,
        "patch_size": PATCH,
        "temporal_patch_size": 2,
        "merge_size": MERGE,
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_convert_rgb": True,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    return path
