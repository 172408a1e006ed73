"""Tests of the tiny-model factory that other tests build on."""

import json
import pathlib
import subprocess
import sys

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load_model, load_tokenizer
from tiny_models import (
    ADAPTED_FAMILIES,
    ALTUP_FAMILIES,
    CACHELIST_FAMILIES,
    EXTRA_FAMILIES,
    FAMILIES,
    MOE_FAMILIES,
    MULTIPLIER_FAMILIES,
    ROW_BY_ROW_FAMILIES,
    SCALED_FAMILIES,
    SPECIAL_TOKENS,
    make_tiny_model,
)

TEXT = "Hello, world! 123 café 東京 🙂"
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Tell me about the Moon mission in 1969."},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module", params=FAMILIES + EXTRA_FAMILIES)
def loaded(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    model, tokenizer = mlx_lm.load(str(path))
    return request.param, path, model, tokenizer


def _generate(model, tokenizer, prompt, **kwargs):
    return [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, **kwargs)]


def test_load_pieces(loaded):
    family, path, model, tokenizer = loaded
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == family
    assert config["vocab_size"] == len(tokenizer)
    model2, _ = load_model(path)
    assert type(model2) is type(model)
    assert load_tokenizer(path).eos_token_ids == tokenizer.eos_token_ids
    assert all(v.dtype == mx.float32 for _, v in mx.load(str(path / "model.safetensors")).items())


def test_greedy_generation_varies(loaded):
    _, _, model, tokenizer = loaded
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    tokens = _generate(model, tokenizer, prompt, max_tokens=30)
    assert len(tokens) == 30
    assert len(set(tokens)) > 3
    assert _generate(model, tokenizer, prompt, max_tokens=30) == tokens


def test_sampling_varies(loaded):
    _, _, model, tokenizer = loaded
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    mx.random.seed(0)
    sampler = make_sampler(temp=0.8)
    runs = [tuple(_generate(model, tokenizer, prompt, max_tokens=20, sampler=sampler))]
    runs.append(tuple(_generate(model, tokenizer, prompt, max_tokens=20, sampler=sampler)))
    assert runs[0] != runs[1]


def test_tokenizer(loaded):
    _, _, _, tokenizer = loaded
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert tokenizer.decode(ids) == TEXT
    # Multi-byte characters span several tokens, and streaming reassembles them.
    assert len(tokenizer.encode("東", add_special_tokens=False)) > 1
    assert len(tokenizer.encode("🙂", add_special_tokens=False)) > 1
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for i in ids:
        detokenizer.add_token(i)
    detokenizer.finalize()
    assert detokenizer.text == TEXT
    for token in SPECIAL_TOKENS:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in tokenizer.eos_token_ids
    assert tokenizer.decode([1, *ids, 2], skip_special_tokens=True) == TEXT


def test_chat_template(loaded):
    _, _, _, tokenizer = loaded
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n")
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]
    assert tokenizer.apply_chat_template(parts, add_generation_prompt=True, tokenize=False) == text
    no_think = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert no_think == text + "<think>\n\n</think>\n\n"

    with_tools = tokenizer.apply_chat_template(
        MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert "<tools>" in with_tools and '"name": "get_weather"' in with_tools
    assert tokenizer.has_tool_calling and tokenizer.tool_call_start == "<tool_call>"

    history = MESSAGES + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"a": 1}}}
            ],
        },
        {"role": "tool", "content": "sunny"},
    ]
    text = tokenizer.apply_chat_template(history, tools=TOOLS, tokenize=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"a": 1}}\n</tool_call>' in text
    assert text.endswith("<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n")


OTHER_FAMILIES = (
    MOE_FAMILIES
    + CACHELIST_FAMILIES
    + MULTIPLIER_FAMILIES
    + SCALED_FAMILIES
    + ADAPTED_FAMILIES
    + ROW_BY_ROW_FAMILIES
    + ALTUP_FAMILIES
)


@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_other_families_load_and_generate_varied_text(tmp_path, family):
    """The MoE, MLA, hybrid and other families: mlx-lm loads them with no weight left
    over or missing, and greedy decoding does not repeat one token."""
    path = make_tiny_model(tmp_path / family, family, num_layers=4)
    model, tokenizer = mlx_lm.load(str(path))
    assert json.loads((path / "config.json").read_text())["model_type"] == family
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    tokens = _generate(model, tokenizer, prompt, max_tokens=20)
    assert len(set(tokens)) > 3


@pytest.mark.parametrize("family", FAMILIES + EXTRA_FAMILIES + OTHER_FAMILIES)
def test_deterministic(tmp_path, family):
    make_tiny_model(tmp_path / "a", family)
    mx.random.normal((3,))  # the global RNG state must not matter
    make_tiny_model(tmp_path / "b", family)
    make_tiny_model(tmp_path / "c", family, seed=1)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    weights = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert weights != (tmp_path / "c" / "model.safetensors").read_bytes()


def test_deterministic_across_processes(tmp_path):
    """BPE training and weight init give the same bytes in a fresh process."""
    code = (
        "import sys; from tiny_models import make_tiny_model; make_tiny_model(sys.argv[1], 'qwen3')"
    )
    here = pathlib.Path(__file__).parent
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "a")], cwd=here, check=True)
    make_tiny_model(tmp_path / "b", "qwen3")
    for name in ("tokenizer.json", "model.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


@pytest.mark.parametrize("family", ["gemma3_text", "llama"])
def test_sliding_window(tmp_path, family):
    """Sliding layers get rotating caches and change logits past the window."""
    window = 16 if family == "gemma3_text" else 8
    small = make_tiny_model(tmp_path / "small", family, sliding_window=window)
    large = make_tiny_model(tmp_path / "large", family, sliding_window=4096)
    (model, _), (reference, _) = load_model(small), load_model(large)
    kinds = [type(c) for c in make_prompt_cache(model)]
    assert kinds == [RotatingKVCache, RotatingKVCache, KVCache, RotatingKVCache, RotatingKVCache]

    tokens = mx.arange(10, 10 + 2 * window)[None]
    inside = mx.abs(model(tokens[:, :window]) - reference(tokens[:, :window])).max()
    beyond = mx.abs(model(tokens)[:, window:] - reference(tokens)[:, window:]).max()
    assert inside.item() < 1e-4 < beyond.item()

    # Incremental decoding through the rotating caches matches a full pass.
    cache = make_prompt_cache(model)
    model(tokens[:, :window], cache=cache)
    steps = [model(tokens[:, i : i + 1], cache=cache) for i in range(window, 2 * window)]
    assert mx.allclose(mx.concatenate(steps, axis=1), model(tokens)[:, window:], atol=1e-4)


def test_options(tmp_path):
    path = make_tiny_model(tmp_path / "m", "qwen3", num_layers=2, hidden_size=32, seed=3)
    config = json.loads((path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["head_dim"]) == (2, 32, 8)
    weights = mx.load(str(path / "model.safetensors"))
    assert "lm_head.weight" not in weights

    path = make_tiny_model(tmp_path / "u", "qwen3", tie_word_embeddings=False)
    assert "lm_head.weight" in mx.load(str(path / "model.safetensors"))
    path = make_tiny_model(tmp_path / "g", "gemma3_text", tie_word_embeddings=False)
    model, _ = load_model(path)
    assert "lm_head" in model
    with pytest.raises(ValueError):
        make_tiny_model(tmp_path / "q", "qwen2", sliding_window=8)
    with pytest.raises(ValueError):
        make_tiny_model(tmp_path / "x", "gpt2")
