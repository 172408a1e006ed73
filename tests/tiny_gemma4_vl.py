"""A tiny random-weight Gemma 4 vision-language model in mlx-vlm's layout, for tests.

Its text model has Gemma 4's E2B/E4B features (per-layer inputs, KV-shared last
layers, sliding and full attention, image tokens attending to each other: the config's
`use_bidirectional_attention: "vision"`), its vision tower is 2 layers on 4x4-pixel
patches pooled 2x2, and its processor files (Gemma4Processor) are written beside it.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_vlm.models import gemma4
from tiny_models import (
    CHAT_TEMPLATE,
    GEMMA_EMBED_RMS,
    LOGIT_STD,
    _init_weights,
    add_special_tokens,
    write_tokenizer,
)

NUM_LAYERS = 6
WINDOW = 16  # sliding window of the local layers: an image prompt is longer
# Layers 4 (sliding) and 5 (full) reuse layers 3 and 2: the last rank holds [2, 6).
KV_SHARED = 2
TAIL = 4
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
BOI, EOI, IMAGE = "<|image>", "<image|>", "<|image|>"
PATCH, POOL, MAX_SOFT_TOKENS = 4, 2, 9  # a 40x32 picture: 16x24 pixels, 6 image tokens

# The text models' template, with Gemma 4's image placeholder for image parts (its
# processor expands each to begin-of-image, the image's soft tokens, end-of-image).
TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- for part in content if part.type == 'text' %}{{- part.text }}{%- endfor %}",
    "{%- for part in content %}{%- if part.type in ('image', 'image_url') %}"
    "{{- '" + IMAGE + "' }}{%- elif part.type == 'text' %}{{- part.text }}{%- endif %}"
    "{%- endfor %}",
)
assert TEMPLATE != CHAT_TEMPLATE


def make_tiny_gemma4_vlm(
    path: Path, *, per_layer: bool = True, hidden_size: int = 64, seed: int = 0
) -> Path:
    """Write the tiny Gemma 4 VLM and its processor files into `path`; return it.
    `per_layer`: the E2B/E4B layout (per-layer inputs, KV-shared layers, whose MLPs
    are twice as wide); else the 26B/31B one (neither; full attention's keys are its
    values, over wider heads; an MoE block beside each dense MLP)."""
    path = write_tokenizer(path)
    ids = add_special_tokens(
        path,
        (BOI, EOI, IMAGE, "<|video|>"),
        TEMPLATE,
        {"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE},
    )
    vocab = ids["<|video|>"] + 1
    heads, head_dim = 4, hidden_size // 4
    text = {
        "model_type": "gemma4_text",
        "hidden_size": hidden_size,
        "num_hidden_layers": NUM_LAYERS,
        "intermediate_size": 2 * hidden_size,
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        "global_head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "vocab_size_per_layer_input": vocab,
        "hidden_size_per_layer_input": 8 if per_layer else 0,
        "num_kv_shared_layers": KV_SHARED if per_layer else 0,
        "use_double_wide_mlp": per_layer,
        "layer_types": LAYER_TYPES,
        "sliding_window": WINDOW,
        "max_position_embeddings": 2048,
        "final_logit_softcapping": 30.0,
        "use_bidirectional_attention": "vision",
        "tie_word_embeddings": True,
    }
    if not per_layer:
        text.update(
            global_head_dim=2 * head_dim,
            attention_k_eq_v=True,
            num_global_key_value_heads=1,
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=hidden_size,
        )
    vision = {
        "model_type": "gemma4_vision",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 16,
        "patch_size": PATCH,
        "pooling_kernel_size": POOL,
        "position_embedding_size": 64,
        "default_output_length": MAX_SOFT_TOKENS,
    }
    config = {
        "model_type": "gemma4",
        "architectures": ["Gemma4ForConditionalGeneration"],
        "image_token_id": ids[IMAGE],
        "boi_token_id": ids[BOI],
        "eoi_token_id": ids[EOI],
        "audio_token_id": vocab + 1,  # (no audio: an id no prompt has)
        "vision_soft_tokens_per_image": MAX_SOFT_TOKENS,
        "hidden_size": hidden_size,
        "vocab_size": vocab,
        "pad_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
        "text_config": text,
        "vision_config": vision,
    }
    model_config = gemma4.ModelConfig.from_dict(config)
    model_config.text_config = gemma4.TextConfig.from_dict(text)
    model_config.vision_config = gemma4.VisionConfig.from_dict(vision)
    model = gemma4.Model(model_config)
    _init_weights(model, seed, gemma=False)
    # As tiny_models does for gemma4_text: q/k norms at 1 (its attention does not scale
    # scores), a small embedding against the layers, the final norm giving logit scale.
    inner = model.language_model.model
    for layer in inner.layers:
        attn = layer.self_attn
        attn.q_norm.weight = mx.ones_like(attn.q_norm.weight)
        if "k_norm" in attn:
            attn.k_norm.weight = mx.ones_like(attn.k_norm.weight)
    inner.embed_tokens.weight = inner.embed_tokens.weight * (GEMMA_EMBED_RMS / LOGIT_STD)
    inner.norm.weight = mx.full(inner.norm.weight.shape, LOGIT_STD / GEMMA_EMBED_RMS)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    processor = {
        "processor_class": "Gemma4Processor",
        "image_processor": {
            "image_processor_type": "Gemma4ImageProcessor",
            "patch_size": PATCH,
            "pooling_kernel_size": POOL,
            "max_soft_tokens": MAX_SOFT_TOKENS,
            "do_normalize": False,
        },
    }
    (path / "processor_config.json").write_text(json.dumps(processor, indent=2))
    return path
