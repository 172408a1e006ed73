"""Tiny random-weight mlx-lm models, made at test time.

Tests need real model directories (config.json, safetensors, tokenizer files)
that ``mlx_lm.load`` accepts, but no model hub is reachable and real weights
are far too slow on a 2-core CPU. ``make_tiny_model`` writes one in a few tens
of milliseconds: a byte-level BPE tokenizer trained on a small embedded corpus,
a ChatML chat template with tools and thinking, and seeded random float32
weights scaled so that generation is varied rather than one token repeated.
"""

from __future__ import annotations

import functools
import json
import pathlib

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import _get_classes

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3_text", "mistral", "phi3")

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

NUM_HEADS = 4
NUM_KV_HEADS = 2
DEFAULT_SLIDING_WINDOW = 16
SLIDING_WINDOW_PATTERN = 3

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
# an empty think block as Qwen3 does.
CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' }}
{{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'user' or message.role == 'system' %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
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
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""


@functools.cache
def _tokenizer_json() -> str:
    """Train the byte-level BPE once per process; training is deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer.to_str()


def tokenizer_files(path: pathlib.Path) -> int:
    """Write tokenizer.json and tokenizer_config.json into ``path``.

    Returns the vocabulary size (special tokens included), which the model's
    embedding must match.
    """
    path.mkdir(parents=True, exist_ok=True)
    tokenizer_json = _tokenizer_json()
    (path / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    content = json.loads(tokenizer_json)
    added = {str(t.pop("id")): t for t in content["added_tokens"]}
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
    (path / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8"
    )
    return len(content["model"]["vocab"]) + sum(
        t["content"] not in content["model"]["vocab"] for t in content["added_tokens"]
    )


def _config(
    family: str,
    vocab_size: int,
    eos_id: int,
    num_layers: int,
    hidden_size: int,
    tie_word_embeddings: bool | None,
    sliding_window: int | None,
) -> dict:
    """An HF-style config.json for ``family`` with small dimensions."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    if hidden_size % NUM_HEADS:
        raise ValueError(f"hidden_size must be a multiple of {NUM_HEADS}")
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
        "vocab_size": vocab_size,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "tie_word_embeddings": family in ("qwen2", "qwen3", "gemma3_text"),
        "torch_dtype": "float32",
        "eos_token_id": eos_id,
    }
    if tie_word_embeddings is not None:
        config["tie_word_embeddings"] = tie_word_embeddings
    pattern = max(1, min(SLIDING_WINDOW_PATTERN, num_layers))
    if family == "gemma3_text":
        config.update(
            sliding_window=sliding_window or DEFAULT_SLIDING_WINDOW,
            sliding_window_pattern=pattern,
            query_pre_attn_scalar=head_dim,
            rope_local_base_freq=10000.0,
        )
    elif sliding_window is not None:
        if family not in ("llama", "mistral"):
            raise ValueError(f"{family} has no sliding-window attention in mlx-lm")
        config["sliding_window"] = sliding_window
        config["layer_types"] = [
            "full_attention" if i % pattern == pattern - 1 else "sliding_attention"
            for i in range(num_layers)
        ]
    return config


INIT_STD = 2.0
LOGIT_STD = 2.5
GEMMA_EMBED_RMS = 0.5
QK_NORM = 3.0
SPECIAL_TOKEN_SCALE = 0.1


def _init_weights(model: nn.Module, seed: int, gemma: bool) -> None:
    """Re-draw every weight from ``seed`` with explicit keys.

    Explicit keys make the weights depend on ``seed`` alone (not on how much of
    mlx's global RNG the constructors used) and leave the caller's RNG alone.

    The scales matter. Default inits give flat logits (sampling is noise), and
    tied embeddings that dominate the residual stream make the model echo its
    input, so greedy decoding repeats one token forever. Hence: matrices at
    ``INIT_STD / sqrt(fan_in)`` so the layers outweigh the embedding, and
    embeddings / lm_head scaled so the logits have std ``LOGIT_STD``. Gemma
    multiplies embeddings by sqrt(hidden) and normalises every layer output,
    so there the embedding is kept small and the final norm (gemma norms scale
    by ``1 + weight``) does the logit scaling.
    """
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    new = []
    for (name, w), key in zip(params, keys):
        fan_in = w.shape[-1]
        if "q_norm" in name or "k_norm" in name:
            w = mx.full(w.shape, QK_NORM - 1.0 if gemma else QK_NORM)
        elif "norm" in name:
            if not gemma:
                w = mx.ones_like(w)
            elif name == "model.norm.weight":
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
) -> pathlib.Path:
    """Write a tiny random-weight model of ``family`` into ``path``; return it.

    The same arguments always give byte-identical files. ``sliding_window``
    sets gemma3_text's window (default 16) and, for llama/mistral, turns on
    sliding attention in all but every third layer.
    """
    path = pathlib.Path(path)
    vocab_size = tokenizer_files(path)
    eos_id = json.loads(_tokenizer_json())["model"]["vocab"][EOS_TOKEN]
    config = _config(
        family, vocab_size, eos_id, num_layers, hidden_size, tie_word_embeddings, sliding_window
    )
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    _init_weights(model, seed, gemma=family == "gemma3_text")
    weights = dict(tree_flatten(model.parameters()))
    if config["tie_word_embeddings"]:
        weights.pop("lm_head.weight", None)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return path
