"""Random-weight models of real shapes, for measuring speed where no checkpoint can be had.

    .venv/bin/python bench/shapes.py llama3-8b /tmp/llama3-8b [--tokenizer DIR]

Speed depends on a model's shape and quantization, not on its weights, so a model with
random weights of Llama-3-8B's shape costs what Llama-3-8B costs. Every shape but
`tiny` uses the tokenizer of the default model (SmolLM2's 49,152 tokens, so every id
the model samples decodes); its vocabulary, not the original's, sets the LM head's size.
`tiny` is the test suite's tiny llama (hidden 96, 8 layers, float32), where the
engine's per-step costs show even on a CPU. mlx-lm's own pipeline (`mlx_lm.server
--pipeline`) runs only some families, qwen2 among them and llama not: the `-qwen2` shapes
are the same sizes as qwen2 models (q/k/v biases added) for comparing against it.

Weights are drawn lazily and quantized one layer at a time, so making a 32B shape
needs about one layer's float16 weights beyond the 4-bit model itself.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
VOCAB = 49152  # the default model's tokenizer

_LLAMA = {
    "model_type": "llama",
    "rms_norm_eps": 1e-5,
    "vocab_size": VOCAB,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# name -> (config overrides, quantization bits or None)
SHAPES: dict[str, tuple[dict[str, Any], int | None]] = {
    "smollm2-135m": (
        {
            "hidden_size": 576,
            "num_hidden_layers": 30,
            "intermediate_size": 1536,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "rope_theta": 100000.0,
            "tie_word_embeddings": True,
        },
        4,
    ),
    "llama3-8b": (
        {
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "rope_theta": 500000.0,
        },
        4,
    ),
    "llama3-8b-qwen2": (
        {
            "model_type": "qwen2",
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "rope_theta": 500000.0,
        },
        4,
    ),
    "qwen2.5-32b": (
        {
            "model_type": "qwen2",
            "hidden_size": 5120,
            "num_hidden_layers": 64,
            "intermediate_size": 27648,
            "num_attention_heads": 40,
            "num_key_value_heads": 8,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
        },
        4,
    ),
    "llama3-70b": (
        {
            "hidden_size": 8192,
            "num_hidden_layers": 80,
            "intermediate_size": 28672,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "rope_theta": 500000.0,
        },
        4,
    ),
    # The 70B's depth and head ratio at a width a CPU computes in no time (float32, not
    # quantized: MLX's CPU runs 4-bit bfloat16 matmuls at ~2 s a token even this thin): a
    # decode step's cost here is the host's, building and dispatching 80 layers' graph,
    # the part that bounds the 70B split on GPUs (bench/RESULTS.md, session 37).
    "llama3-70b-thin": (
        {
            "hidden_size": 128,
            "num_hidden_layers": 80,
            "intermediate_size": 448,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "rope_theta": 500000.0,
            "torch_dtype": "float32",
        },
        None,
    ),
}
NAMES = ("tiny", "tiny-qwen2", *SHAPES)


def cache_dir() -> Path:
    """Where benchmarks keep the shapes they made (`$MLX_RELAY_BENCH_MODELS` overrides)."""
    return Path(os.environ.get("MLX_RELAY_BENCH_MODELS", Path.home() / ".cache/mlx-relay/bench"))


def default_tokenizer_dir() -> Path:
    """`$MLX_RELAY_BENCH_TOKENIZER`, else the default model's (converted if need be)."""
    if os.environ.get("MLX_RELAY_BENCH_TOKENIZER"):
        return Path(os.environ["MLX_RELAY_BENCH_TOKENIZER"])
    from mlx_relay.model.default_model import resolve_model

    return resolve_model("default", progress=False)


def make_shape(name: str, out: Path, tokenizer_dir: Path | None = None) -> Path:
    """Write model `name` into `out` (once: an existing complete directory is reused)."""
    out = Path(out)
    if (out / "config.json").exists():
        return out
    if name.startswith("tiny"):
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny_models import make_tiny_model

        family = "qwen2" if name == "tiny-qwen2" else "llama"
        return _write_index(make_tiny_model(out, family, num_layers=8, hidden_size=96))
    overrides, bits = SHAPES[name]
    config = {**_LLAMA, **overrides}
    out.mkdir(parents=True, exist_ok=True)
    source = Path(tokenizer_dir) if tokenizer_dir else default_tokenizer_dir()
    for f in TOKENIZER_FILES:
        shutil.copy(source / f, out / f)
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(0)
    model = arch.Model(arch.ModelArgs.from_dict(config))  # lazy: nothing drawn yet
    dtype = config.get("torch_dtype", "bfloat16")
    model.set_dtype(getattr(mx, dtype))
    if bits:
        config["quantization"] = {"group_size": 64, "bits": bits}
        nn.quantize(model, group_size=64, bits=bits)
    for layer in model.model.layers:  # draw and quantize one layer at a time
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    config["torch_dtype"] = dtype
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_index(out)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out


def _write_index(out: Path) -> Path:
    """The index of a one-file checkpoint: mlx-lm's `sharded_load` (its pipeline) reads it."""
    from mlx_relay.model.checkpoint import tensors

    names = tensors(out)
    index = {"metadata": {}, "weight_map": dict.fromkeys(sorted(names), "model.safetensors")}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=NAMES)
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer", type=Path, help="directory with the tokenizer files")
    args = ap.parse_args()
    print(make_shape(args.shape, args.out, args.tokenizer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
