"""Tiny random-weight mlx-lm models, made at test time.

Tests need real model directories that ``mlx_lm.load`` accepts, but no model
hub is reachable and real checkpoints are far too slow on a small CPU.
``make_tiny_model`` writes one in a few tens of milliseconds: a byte-level BPE
tokenizer trained on a small embedded corpus, a ChatML chat template with
tools and thinking, and seeded random float32 weights scaled so that
generation varies instead of repeating one token.
"""

from __future__ import annotations

import functools
import importlib
import json
import pathlib

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import MODEL_REMAPPING

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3_text")
# Also work, but are left out of FAMILIES so that tests parametrised over it
# stay fast: mistral is llama under another model_type, phi3 fuses qkv_proj
# and gate_up_proj.
EXTRA_FAMILIES = ("mistral", "phi3")
# The non-uniform families people split: mixture-of-experts (a dense first layer then
# MoE layers where the family has one), MLA attention, alternating sliding-window
# layers, hybrid linear attention (conv + gated-delta state). tests/test_families.py
# runs them through clusters; they are not in FAMILIES to keep that matrix small.
MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "qwen3_next", "glm4_moe")
# A family whose layers each keep a CacheList (DeepSeek-V3.2: MLA attention's cache and
# its sparse indexer's), otherwise deepseek_v3's MLA + MoE.
CACHELIST_FAMILIES = ("deepseek_v32",)
# gemma2 scales its embeddings by sqrt(hidden_size) as a float (gemma3 rounds it to
# bfloat16 first) and soft-caps attention and final logits.
SCALED_FAMILIES = ("gemma2",)
# Families whose own forward scales embeddings and/or logits by config multipliers
# around the layers (rank 0's embed and head apply the same); some also mix MoE,
# sliding-window, MLA, mamba or conv layers.
MULTIPLIER_FAMILIES = (
    "granite",
    "granitemoe",
    "granitemoehybrid",
    "minicpm",
    "minicpm3",
    "cohere",
    "cohere2",
    "afmoe",
    "gear",
    "muse_glimmer",
)
# Families whose forward calls its layers with more than (x, mask, cache) or whose
# decoder's parts have other names: gemma4_text (layers return a tuple; MoE beside the
# MLP, K = V on full attention, sliding layers; soft-capped logits), falcon_h1 (mamba
# mixer and attention side by side in every layer, one CacheList each, two masks; a
# tied head's multiplier), nanochat (model.transformer.h, wte, weightless norms,
# soft-capped logits). tests/test_multiplier_families.py runs them through clusters.
# recurrent_gemma (RG-LRU recurrent and local-attention blocks, (x, cache, mask) layers,
# final_norm, soft-capped logits).
ADAPTED_FAMILIES = ("gemma4_text", "falcon_h1", "nanochat", "recurrent_gemma")
# Refused at load although its stages are exact one sequence at a time (its block-sparse
# attention is not exact in padded batches): phi3small (block-sparse attention on every
# other layer, LayerNorms, final_layernorm, muP multipliers, a head that masks fixed dummy
# ids, so a vocabulary of PHI3SMALL_VOCAB rows of which only the tokenizer's first
# VOCAB_SIZE can win).
ROW_BY_ROW_FAMILIES = ("phi3small",)
# gemma3n (text model): AltUp streams as the hidden state, Laurel blocks, activation
# sparsity on its first layers, per-layer inputs (a per-layer table of its first
# GEMMA3N_PER_LAYER_VOCAB ids) and its last GEMMA3N_KV_SHARED layers reusing earlier
# layers' keys and values; its config nests a text_config. tests/test_gemma3n.py.
ALTUP_FAMILIES = ("gemma3n",)
GEMMA3N_KV_SHARED = 2
GEMMA3N_PER_LAYER_VOCAB = 256
PHI3SMALL_VOCAB = 100352
NUM_EXPERTS = 4
EXPERTS_PER_TOKEN = 2

# The trainer gives special tokens the ids 0..6 in this order.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
VOCAB_SIZE = 512
# Configs mlx-relay refuses at load, as (family, make_tiny_model's `overrides`), to
# test that refusal: gemma4_text as the E2B/E4B, with per-layer inputs and KV caches
# shared across layers; a family with no logits rule whose config soft-caps its logits.
UNSPLITTABLE = (("llama", (("final_logit_softcapping", 30.0),)),)

NUM_HEADS = 4
NUM_KV_HEADS = 2
DEFAULT_SLIDING_WINDOW = 16
DEFAULT_SLIDING_WINDOW_PATTERN = 3

# Weight scales; see _init_weights for why they are what they are.
INIT_STD = 2.0
LOGIT_STD = 2.5
GEMMA_EMBED_RMS = 0.1
QK_NORM = 4.0
SPECIAL_TOKEN_SCALE = 0.1

# Varied text so the BPE merges cover words, digits, punctuation, code, chat
# markup and some multi-byte characters. Edit it and every model changes.
CORPUS = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles "
    "begins with a single step, and the first step is often the hardest one.",
    "In 1969, three astronauts flew 384,400 km to the Moon; the mission lasted "
    "8 days, 3 hours and 18 minutes. Pi is about 3.14159, e is about 2.71828.",
    "Hello, world! How are you today? I'm fine, thanks - and you? Let's meet at "
    "10:30 on 2024-05-17 (Friday) near the café on Rue de la Paix.",
    "You are a helpful assistant. The user asks a question, the assistant thinks "
    "step by step and then answers. When a tool is needed, the assistant calls "
    "a function with JSON arguments and waits for the tool's response.",
    'def add(a, b):\n    return a + b\n\nprint(add(2, 40))  # prints 42\n{"name": '
    '"get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "Weather report: sunny, 23°C, wind 12 km/h from the north-west. Tomorrow: "
    "rain, 17°C. Über den Wolken, naïve résumé, jalapeño, façade, smörgåsbord.",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다. "
    "Emoji: 🙂 🚀 🎉 ✅ — quotes “like this” and ‘this’, ellipsis… done.",
    "Pipelines split a model's layers across machines: the first stage embeds "
    "tokens, middle stages pass hidden states, and the last stage samples the "
    "next token. Caches keep keys and values so each step only costs one token.",
)

# Qwen2.5/Qwen3-style ChatML. "<tool_call>" together with "tool_call.name" is
# what makes mlx-lm pick its json_tools parser; "enable_thinking=False" closes
# an empty think block as Qwen3 does. Content may be a string or a list of
# OpenAI-style parts, of which the text parts are kept.
CHAT_TEMPLATE = """\
{%- macro text(content) %}
{%- if content is string %}{{- content }}
{%- elif content %}{%- for part in content if part.type == 'text' %}{{- part.text }}{%- endfor %}
{%- endif %}
{%- endmacro %}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages and messages[0].role == 'system' %}{{- text(messages[0].content) + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' }}
{{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + text(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'user' or message.role == 'system' %}
{{- '<|im_start|>' + message.role + '\\n' + text(message.content) + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + text(message.content) }}{%- endif %}
{%- if message.tool_calls %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}
{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + text(message.content) + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""


# Qwen2's split pattern. transformers 5 loads qwen2 checkpoints through
# Qwen2Tokenizer, which rebuilds the normaliser and pre-tokenizer with exactly
# these, so using them everywhere keeps every family (and a plain
# tokenizers.Tokenizer on tokenizer.json) encoding identically.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


@functools.cache
def _tokenizer_json() -> str:
    """Train the byte-level BPE once per process; training is deterministic."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    return tokenizer.to_str()


def _vocab() -> dict[str, int]:
    return json.loads(_tokenizer_json())["model"]["vocab"]


def write_tokenizer(path: pathlib.Path) -> pathlib.Path:
    """Write tokenizer.json and tokenizer_config.json into ``path``; return it.

    ``tokenizer_class`` is PreTrainedTokenizerFast so transformers builds the
    tokenizer from tokenizer.json as is (qwen2 gets Qwen2Tokenizer, which
    rebuilds the same pipeline). ``added_tokens_decoder`` marks the special
    tokens special, so decoding with skip_special_tokens drops them.
    """
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer_json = _tokenizer_json()
    (path / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    added = {}
    for token in json.loads(tokenizer_json)["added_tokens"]:
        added[str(token.pop("id"))] = token
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    text = json.dumps(config, indent=2, ensure_ascii=False)
    (path / "tokenizer_config.json").write_text(text, encoding="utf-8")
    return path


def add_special_tokens(
    path: pathlib.Path,
    tokens: tuple[str, ...],
    chat_template: str,
    extra_special_tokens: dict[str, str] | None = None,
) -> dict[str, int]:
    """Append special tokens (a VLM's image markers) to the tiny tokenizer that
    ``write_tokenizer`` wrote in ``path``, with the VLM's chat template; their ids."""
    tokenizer = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    ids: dict[str, int] = {}
    for token in tokens:
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
        config["added_tokens_decoder"][str(ids[token])] = added
    if extra_special_tokens:
        config["extra_special_tokens"] = extra_special_tokens
    config["chat_template"] = chat_template
    (path / "tokenizer.json").write_text(json.dumps(tokenizer), encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return ids


def _config(
    family: str,
    num_layers: int,
    hidden_size: int,
    tie_word_embeddings: bool | None,
    sliding_window: int | None,
    sliding_window_pattern: int | None,
) -> dict:
    """An HF-style config.json for ``family`` with small dimensions."""
    known = (
        FAMILIES
        + EXTRA_FAMILIES
        + MOE_FAMILIES
        + CACHELIST_FAMILIES
        + SCALED_FAMILIES
        + MULTIPLIER_FAMILIES
        + ADAPTED_FAMILIES
        + ROW_BY_ROW_FAMILIES
    )
    if family not in known:
        raise ValueError(f"unknown family {family!r}; expected one of {known}")
    if hidden_size % NUM_HEADS:
        raise ValueError(f"hidden_size must be a multiple of {NUM_HEADS}")
    vocab = _vocab()
    head_dim = hidden_size // NUM_HEADS
    config = {
        "model_type": family,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": 2 * hidden_size,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "vocab_size": len(vocab),
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "tie_word_embeddings": family in ("qwen2", "qwen3", "gemma3_text", "gemma2"),
        "torch_dtype": "float32",
        "eos_token_id": vocab[EOS_TOKEN],
        # transformers reads config.json too and warns about e.g. phi3's
        # default pad id 32000 being outside the vocabulary.
        "pad_token_id": vocab[PAD_TOKEN],
    }
    if tie_word_embeddings is not None:
        config["tie_word_embeddings"] = tie_word_embeddings
    # Full attention on every pattern-th layer (gemma3's rule), at least one.
    pattern = max(1, min(sliding_window_pattern or DEFAULT_SLIDING_WINDOW_PATTERN, num_layers))
    if family == "gemma3_text":
        config.update(
            sliding_window=sliding_window or DEFAULT_SLIDING_WINDOW,
            sliding_window_pattern=pattern,
            query_pre_attn_scalar=head_dim,
            rope_local_base_freq=10000.0,
        )
    elif family == "gpt_oss":  # sliding on even layers, full on odd ones (gpt-oss's own)
        config["sliding_window"] = sliding_window or DEFAULT_SLIDING_WINDOW // 2
        config["layer_types"] = [
            "full_attention" if i % 2 else "sliding_attention" for i in range(num_layers)
        ]
    elif sliding_window is not None:
        if family not in ("llama", "mistral"):
            raise ValueError(f"mlx-lm's {family} has no sliding-window attention")
        config["sliding_window"] = sliding_window
        config["layer_types"] = [
            "full_attention" if i % pattern == pattern - 1 else "sliding_attention"
            for i in range(num_layers)
        ]
    config.update(_moe_config(family, num_layers, hidden_size, head_dim))
    config.update(_multiplier_config(family, num_layers, hidden_size, head_dim))
    return config


def _multiplier_config(family: str, num_layers: int, hidden_size: int, head_dim: int) -> dict:
    """The config multipliers (and the layer mixes) of MULTIPLIER_FAMILIES."""
    experts = {"num_local_experts": NUM_EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN}
    window = DEFAULT_SLIDING_WINDOW // 2
    granite = {
        "embedding_multiplier": 2.0,
        "attention_multiplier": head_dim**-0.5,
        "residual_multiplier": 0.5,
        "logits_scaling": 0.5,
        "attention_bias": False,
        "mlp_bias": False,
    }
    minicpm = {"dim_model_base": hidden_size // 2, "scale_depth": 1.4, "scale_emb": 3}
    if family == "granite":
        return granite
    if family == "granitemoe":
        return {**granite, **experts}
    if family == "granitemoehybrid":  # mamba layers, attention on every 3rd, MoE MLPs
        return {
            **granite,
            **experts,
            "shared_intermediate_size": hidden_size,
            "layer_types": ["attention" if i % 3 == 2 else "mamba" for i in range(num_layers)],
            "mamba_n_heads": 4,
            "mamba_expand": 2,  # transformers checks heads x head dim = 2 x hidden
            "mamba_d_head": 2 * hidden_size // 4,
            "mamba_proj_bias": False,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_n_groups": 1,
            "mamba_conv_bias": True,
            "position_embedding_type": "rope",
        }
    if family == "minicpm":
        return minicpm
    if family == "minicpm3":  # MLA attention
        return {
            **minicpm,
            "q_lora_rank": 48,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": head_dim,
            "qk_rope_head_dim": 8,
            "rope_scaling": {
                "original_max_position_embeddings": 2048,
                "short_factor": 1.0,
                "long_factor": 1.0,
            },
        }
    if family in ("cohere", "cohere2"):  # cohere2: sliding window but on every 3rd layer
        return {
            "logit_scale": 0.5,
            "layer_norm_eps": 1e-5,
            **(
                {"sliding_window": window, "sliding_window_pattern": 3}
                if family == "cohere2"
                else {}
            ),
        }
    if family == "afmoe":  # dense first layer then MoE; sliding on all but every 3rd
        return {
            "layer_types": [
                "full_attention" if i % 3 == 2 else "sliding_attention" for i in range(num_layers)
            ],
            "moe_intermediate_size": hidden_size,
            "num_experts": NUM_EXPERTS,
            "num_experts_per_tok": EXPERTS_PER_TOKEN,
            "num_shared_experts": 1,
            "num_dense_layers": 1,
            "sliding_window": window,
            "mup_enabled": True,
        }
    if family == "gear":  # sqrt(hidden)-scaled embeddings, soft-capped logits. No
        # conv_mixer layers: transformers refuses that layer type in config.json.
        return {
            "layer_types": [
                "full_attention" if i % 3 == 2 else "sliding_attention" for i in range(num_layers)
            ],
            "sliding_window": window,
            "final_logit_softcapping": 30.0,
            "query_pre_attn_scalar": head_dim,
        }
    if family == "muse_glimmer":  # normed embeddings; scaled and soft-capped logits
        return {
            "layer_types": [
                "full_attention" if i % 3 == 2 else "sliding_attention" for i in range(num_layers)
            ],
            "sliding_window": window,
            "output_multiplier": 0.5,
            "final_logit_softcapping": 20.0,
        }
    if family == "nanochat":
        return {"num_key_value_heads": NUM_HEADS}
    return _adapted_config(family, num_layers, hidden_size, head_dim)


def _adapted_config(family: str, num_layers: int, hidden_size: int, head_dim: int) -> dict:
    """ADAPTED_FAMILIES' extra config."""
    window = DEFAULT_SLIDING_WINDOW
    if family == "gemma4_text":  # the 26B/31B layout: no per-layer inputs, no KV sharing
        return {
            "layer_types": [
                "full_attention" if i % 3 == 2 else "sliding_attention" for i in range(num_layers)
            ],
            "sliding_window": window,
            "hidden_size_per_layer_input": 0,
            "num_kv_shared_layers": 0,
            "global_head_dim": 2 * head_dim,
            "attention_k_eq_v": True,
            "num_global_key_value_heads": 1,
            "enable_moe_block": True,
            "num_experts": NUM_EXPERTS,
            "top_k_experts": EXPERTS_PER_TOKEN,
            "moe_intermediate_size": hidden_size,
            "final_logit_softcapping": 30.0,
            "tie_word_embeddings": True,
        }
    if family == "phi3small":
        return {
            "dense_attention_every_n_layers": 2,
            "ff_intermediate_size": 2 * hidden_size,
            "gegelu_limit": 20.0,
            "layer_norm_epsilon": 1e-5,
            "vocab_size": PHI3SMALL_VOCAB,
            "blocksparse_block_size": 32,
            "blocksparse_num_local_blocks": 1,
            "blocksparse_vert_stride": 2,
            "tie_word_embeddings": True,
        }
    if family == "recurrent_gemma":  # two recurrent blocks, then local attention
        return {
            "attention_bias": False,
            "conv1d_width": 4,
            "logits_soft_cap": 30.0,
            "num_key_value_heads": 1,
            "attention_window_size": window,
            "block_types": ["recurrent", "recurrent", "attention"],
            "embeddings_scale_by_sqrt_dim": True,
            "layer_norm_epsilon": 1e-6,
            "tie_word_embeddings": True,
        }
    if family == "falcon_h1":
        return {
            "mamba_d_ssm": 2 * hidden_size,
            "mamba_n_heads": 4,
            "mamba_d_head": 2 * hidden_size // 4,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_n_groups": 1,
            "mamba_chunk_size": 16,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
        }
    return {}


def _gemma3n_config(num_layers: int, hidden_size: int, overrides: dict) -> dict:
    """gemma3n's config.json: the text model's settings in text_config (its towers
    left out: mlx-lm runs the text model alone). Full attention on every third layer;
    the last GEMMA3N_KV_SHARED layers (fewer in a model of under 5 layers) reuse the
    last earlier layer of their kind."""
    vocab = _vocab()
    head_dim = hidden_size // NUM_HEADS
    text = {
        "model_type": "gemma3n_text",
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": [2 * hidden_size] * num_layers,  # (per layer, as released)
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "vocab_size": len(vocab),
        "vocab_size_per_layer_input": GEMMA3N_PER_LAYER_VOCAB,
        "hidden_size_per_layer_input": 8,
        # (at most as many as leave a full-attention layer before them, which it needs)
        "num_kv_shared_layers": max(0, min(GEMMA3N_KV_SHARED, num_layers - 3)),
        "sliding_window": DEFAULT_SLIDING_WINDOW,
        "max_position_embeddings": 2048,
        "rope_local_base_freq": 10000.0,
        "rope_theta": 1000000.0,
        "final_logit_softcapping": 30.0,
        "layer_types": [
            "full_attention" if i % 3 == 2 else "sliding_attention" for i in range(num_layers)
        ],
        "activation_sparsity_pattern": [0.95] * 2 + [0.0] * (num_layers - 2),
        "altup_num_inputs": 4,
        "altup_coef_clip": 120.0,
        "altup_correct_scale": True,
        "altup_active_idx": 0,
        "laurel_rank": 8,
    }
    text.update(overrides)
    return {
        "model_type": "gemma3n",
        "text_config": text,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "eos_token_id": vocab[EOS_TOKEN],
        "pad_token_id": vocab[PAD_TOKEN],
    }


def _moe_config(family: str, num_layers: int, hidden_size: int, head_dim: int) -> dict:
    """The expert, MLA and linear-attention settings of the non-dense families."""
    experts = {"num_experts_per_tok": EXPERTS_PER_TOKEN, "moe_intermediate_size": hidden_size}
    if family == "gemma2":
        return {
            "query_pre_attn_scalar": head_dim,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        }
    if family == "qwen3_moe":  # layer 0 dense, the rest MoE
        return {
            **experts,
            "num_experts": NUM_EXPERTS,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [0],
            "norm_topk_prob": True,
        }
    if family in ("mixtral", "gpt_oss"):
        return {"num_local_experts": NUM_EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN}
    if family == "deepseek_v32":  # deepseek_v3 plus a sparse indexer (top 8 positions)
        return {
            **_moe_config("deepseek_v3", num_layers, hidden_size, head_dim),
            "index_head_dim": 16,
            "index_n_heads": 2,
            "index_topk": 8,
        }
    if family == "deepseek_v3":  # MLA; layer 0 dense, the rest routed + shared experts
        return {
            **experts,
            "n_routed_experts": NUM_EXPERTS,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 1.0,
            "kv_lora_rank": 32,
            "q_lora_rank": 48,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": head_dim,
            "v_head_dim": head_dim,
            "num_key_value_heads": NUM_HEADS,
        }
    if family == "glm4_moe":  # layer 0 dense, the rest routed + shared experts
        return {
            **experts,
            "n_routed_experts": NUM_EXPERTS,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 1.0,
            "norm_topk_prob": True,
            "use_qk_norm": True,
            "attention_bias": False,
            "partial_rotary_factor": 0.5,
            "rope_scaling": None,
        }
    if family == "qwen3_next":  # full attention on every 3rd layer, linear on the others
        return {
            **experts,
            "num_experts": NUM_EXPERTS,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "shared_expert_intermediate_size": hidden_size,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": head_dim,
            "linear_value_head_dim": head_dim,
            "linear_conv_kernel_dim": 4,
            "partial_rotary_factor": 0.5,
            "full_attention_interval": min(3, num_layers),
        }
    return {}


def _init_weights(model: nn.Module, seed: int, gemma: bool) -> None:
    """Re-draw every weight from ``seed`` with explicit keys.

    Explicit keys make the weights depend on ``seed`` alone (not on how much of
    mlx's global RNG the constructors used), and the global RNG is not
    reseeded behind the caller's back.

    The scales matter; the default init fails in both directions. Flat logits
    make sampling pure noise, and a tied embedding that dominates the residual
    stream makes the model echo its input so greedy decoding repeats one
    token forever. So: matrices at ``INIT_STD / sqrt(fan_in)`` so the layers
    outweigh the embedding, embedding and lm_head scaled for logits with std
    ``LOGIT_STD``, and QK-norm weights raised so attention is not uniform.
    Gemma scales embeddings by sqrt(hidden) and normalises every layer output,
    so there the embedding is kept small and the final norm (gemma norms scale
    by ``1 + weight``) provides the logit scale. Special tokens get small
    output rows, so free-running generation rarely stops early at EOS.
    """
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    new = []
    for (name, w), key in zip(params, keys, strict=True):
        fan_in = w.shape[-1]
        if (
            "conv1d" in name or "conv_1d" in name
        ) and w.ndim == 3:  # (channels, kernel, 1): a depthwise filter over the kernel
            fan_in = w.shape[1]
        if name.endswith(("layer_scalar", "per_expert_scale", "router.scale")):
            w = mx.ones_like(w)  # gemma4's scales: random 0.02s would erase the residual
        elif "q_norm" in name or "k_norm" in name:
            w = mx.full(w.shape, QK_NORM - 1.0 if gemma else QK_NORM)
        elif "norm" in name:
            if not gemma:
                w = mx.ones_like(w)
            elif name in ("model.norm.weight", "model.final_norm.weight"):
                w = mx.full(w.shape, LOGIT_STD / GEMMA_EMBED_RMS - 1.0)
            else:
                w = mx.zeros_like(w)
        elif "embed_tokens" in name or "lm_head" in name:
            std = GEMMA_EMBED_RMS if gemma else LOGIT_STD
            w = std / fan_in**0.5 * mx.random.normal(w.shape, key=key)
            w[: len(SPECIAL_TOKENS)] *= SPECIAL_TOKEN_SCALE
        elif w.ndim == 1:
            w = 0.02 * mx.random.normal(w.shape, key=key)
        else:
            w = INIT_STD / fan_in**0.5 * mx.random.normal(w.shape, key=key)
        new.append((name, w))
    model.update(tree_unflatten(new))


def make_tiny_model(
    path: pathlib.Path,
    family: str = "llama",
    *,
    num_layers: int = 5,
    hidden_size: int = 64,
    seed: int = 0,
    tie_word_embeddings: bool | None = None,
    sliding_window: int | None = None,
    sliding_window_pattern: int | None = None,
    overrides: tuple[tuple[str, object], ...] = (),
) -> pathlib.Path:
    """Write a tiny random-weight ``family`` model into ``path``; return it.

    The same arguments give byte-identical files. Dimensions: 4 heads, 2 KV
    heads, head_dim ``hidden_size // 4``, intermediate ``2 * hidden_size``,
    float32. Embeddings are tied by default for qwen2, qwen3 and gemma3_text,
    untied for llama.

    gemma3_text always has sliding layers: window ``sliding_window`` (default
    16) on all but every ``sliding_window_pattern``-th layer (default 3,
    capped at ``num_layers``). llama and mistral get the same layout through
    ``layer_types`` when ``sliding_window`` is given; the other families have
    no sliding attention in mlx-lm and reject it.

    EOS is rarely generated spontaneously (see ``_init_weights``); tests that
    need a stop can pass ``eos_token_ids`` or a ``model_config`` override.
    ``overrides``: (key, value) pairs set in config.json last.
    """
    path = write_tokenizer(path)
    if family in ALTUP_FAMILIES:  # overrides: of its text_config
        config = _gemma3n_config(num_layers, hidden_size, dict(overrides))
    else:
        config = _config(
            family,
            num_layers,
            hidden_size,
            tie_word_embeddings,
            sliding_window,
            sliding_window_pattern,
        )
        config.update(dict(overrides))
    arch = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(family, family)}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    _init_weights(model, seed, gemma=family in ("gemma3_text", "gemma2", "recurrent_gemma"))
    if family == "phi3small":
        # Its head masks dummy ids past 100k, so its vocabulary is that large; keep the
        # rows past the tokenizer's out of reach: the final LayerNorm's first output is
        # the constant 1 (weight 0, bias 1), which those rows weigh at -1000.
        inner = model.model
        for layer in inner.layers:  # LayerNorms: _init_weights gave their biases 1s
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.bias = mx.zeros_like(norm.bias)
        inner.final_layernorm.bias = mx.zeros_like(inner.final_layernorm.bias)
        # x mup_embedding_multiplier (10) in, / mup_width_multiplier (8) out: a small
        # embedding against the layers (else greedy echoes its input), logits scaled
        # back up by the final norm's weight
        embed = inner.embed_tokens.weight * 0.1
        inner.final_layernorm.weight = mx.full(inner.final_layernorm.weight.shape, 10.0)
        embed[:, 0] = 0.0
        embed[VOCAB_SIZE:] = 0.0
        embed[VOCAB_SIZE:, 0] = -1000.0
        inner.embed_tokens.weight = embed
        inner.final_layernorm.weight[0] = 0.0
        inner.final_layernorm.bias[0] = 1.0
    if family == "gemma4_text":
        # Its norms scale by their weight (not 1 + weight) and its embeddings by
        # sqrt(hidden): keep the embedding small against the layers (else greedy echoes
        # its input) and let the final norm give the logit scale, as for gemma3.
        # Its attention does not scale scores by 1/sqrt(head_dim) (scale 1.0 after the
        # q/k norms): QK_NORM-raised norm weights would make every softmax one-hot.
        inner = model.model
        for layer in inner.layers:
            attn = layer.self_attn
            attn.q_norm.weight = mx.ones_like(attn.q_norm.weight)
            if "k_norm" in attn:  # KV-shared layers have none
                attn.k_norm.weight = mx.ones_like(attn.k_norm.weight)
        inner.embed_tokens.weight = inner.embed_tokens.weight * (GEMMA_EMBED_RMS / LOGIT_STD)
        inner.norm.weight = mx.full(inner.norm.weight.shape, LOGIT_STD / GEMMA_EMBED_RMS)
    if family == "gemma3n":
        # As gemma4 (plain RMSNorm weights, embeddings x sqrt(hidden), attention scale
        # 1.0 after the q/k norms), and AltUp's output scale at 1 so that the per-layer
        # inputs weigh in (at 0.02 they would hardly change a token).
        inner = model.model.language_model
        for layer in inner.layers:
            attn = layer.self_attn
            attn.q_norm.weight = mx.ones_like(attn.q_norm.weight)
            attn.k_norm.weight = mx.ones_like(attn.k_norm.weight)
            layer.altup.correct_output_scale = mx.ones_like(layer.altup.correct_output_scale)
        inner.embed_tokens.weight = inner.embed_tokens.weight * (GEMMA_EMBED_RMS / LOGIT_STD)
        inner.norm.weight = mx.full(inner.norm.weight.shape, LOGIT_STD / GEMMA_EMBED_RMS)
    weights = dict(tree_flatten(model.parameters()))
    if config["tie_word_embeddings"]:
        # gemma3_text always builds an lm_head and drops it on load when the
        # checkpoint has none; the other families build none when tied.
        weights.pop("lm_head.weight", None)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return path


# A tiny llava (mlx-vlm): a CLIP vision tower of 2 layers on 28x28 images in 14x14 patches
# (4 image tokens once the CLS token is dropped), a 2-layer MLP projector, and a llama
# language model. The chat template writes "<image>" for an image part, which the
# processor expands to one "<image>" token per image feature.
IMAGE_TOKEN = "<image>"
VLM_IMAGE_SIZE = 28
VLM_PATCH_SIZE = 14
VLM_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- for part in content if part.type == 'text' %}{{- part.text }}{%- endfor %}",
    "{%- for part in content %}{%- if part.type in ('image', 'image_url') %}{{- '<image>' }}"
    "{%- elif part.type == 'text' %}{{- part.text }}{%- endif %}{%- endfor %}",
)
assert VLM_CHAT_TEMPLATE != CHAT_TEMPLATE


def make_tiny_vlm(
    path: pathlib.Path, *, num_layers: int = 4, hidden_size: int = 64, seed: int = 0
) -> pathlib.Path:
    """Write a tiny random-weight llava model (mlx-vlm's layout) into ``path``; return it.

    The tokenizer is the text models' plus one added special token, ``<image>``, at the
    end of the vocabulary; ``preprocessor_config.json`` is a CLIP image processor for
    28x28 images.
    """
    from mlx_vlm.models import llava

    path = write_tokenizer(path)
    tokenizer_json = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    image_id = len(tokenizer_json["model"]["vocab"])
    added = {
        "id": image_id,
        "content": IMAGE_TOKEN,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": True,
    }
    tokenizer_json["added_tokens"].append(added)
    (path / "tokenizer.json").write_text(json.dumps(tokenizer_json), encoding="utf-8")
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokenizer_config["added_tokens_decoder"][str(image_id)] = {
        k: v for k, v in added.items() if k != "id"
    }
    tokenizer_config["chat_template"] = VLM_CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    text = _config("llama", num_layers, hidden_size, False, None, None)
    text["vocab_size"] = image_id + 1
    config = {
        "model_type": "llava",
        "architectures": ["LlavaForConditionalGeneration"],
        "image_token_index": image_id,
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "vocab_size": image_id + 1,
        "eos_token_id": text["eos_token_id"],
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": VLM_IMAGE_SIZE,
            "patch_size": VLM_PATCH_SIZE,
            "projection_dim": 32,
            "num_channels": 3,
            "layer_norm_eps": 1e-5,
        },
    }
    model_config = llava.ModelConfig.from_dict(config)
    model_config.text_config = llava.TextConfig.from_dict(text)
    model_config.vision_config = llava.VisionConfig.from_dict(config["vision_config"])
    model = llava.Model(model_config)
    _init_weights(model, seed, gemma=False)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    processor = {
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": "LlavaProcessor",
        "do_resize": True,
        "size": {"shortest_edge": VLM_IMAGE_SIZE},
        "do_center_crop": True,
        "crop_size": {"height": VLM_IMAGE_SIZE, "width": VLM_IMAGE_SIZE},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": mean,
        "image_std": std,
        "do_convert_rgb": True,
        "resample": 3,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    extra = {
        "processor_class": "LlavaProcessor",
        "patch_size": VLM_PATCH_SIZE,
        "vision_feature_select_strategy": "default",
        "image_token": IMAGE_TOKEN,
        "num_additional_image_tokens": 1,
    }
    (path / "processor_config.json").write_text(json.dumps(extra, indent=2))
    return path
