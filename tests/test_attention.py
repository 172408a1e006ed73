"""The unfused attention a verify step uses on CUDA equals MLX's fused kernel (CPU)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_relay.model import attention


def _qkv(heads: int, kv_heads: int, length: int, keys: int) -> tuple[mx.array, ...]:
    mx.random.seed(3)
    q = mx.random.normal((2, heads, length, 16))
    k = mx.random.normal((2, kv_heads, keys, 16))
    v = mx.random.normal((2, kv_heads, keys, 8 * 2))
    return q, k, v


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "additive", "per_head"])
def test_attend_equals_mlx(heads: int, kv_heads: int, mask_kind: str) -> None:
    length, keys = 5, 37
    q, k, v = _qkv(heads, kv_heads, length, keys)
    positions = mx.arange(keys - length, keys)[:, None] >= mx.arange(keys)[None]
    mask = {
        "none": None,
        "causal": "causal",
        "bool": positions,
        "additive": mx.where(positions, 0.0, -1e9)[None, None],
        "per_head": mx.broadcast_to(positions, (2, heads, length, keys)),
    }[mask_kind]
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    got = attention.attend(q, k, v, scale=0.25, mask=mask)
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=1e-5).item()


def test_swapped_only_inside() -> None:
    fused = mx.fast.scaled_dot_product_attention
    with attention.unfused():
        assert mx.fast.scaled_dot_product_attention is attention.attend
    assert mx.fast.scaled_dot_product_attention is fused
    with attention.unfused(False):
        assert mx.fast.scaled_dot_product_attention is fused


def test_not_wanted_off_cuda() -> None:
    assert not attention.wanted()  # (the CPU: nothing changes)


def test_a_model_step_through_it_equals_mlx() -> None:
    """The swap reaches a real model's layers (it looks the function up at each call):
    a 5-position step after a prompt gives the same logits both ways."""
    from mlx_lm.models import llama
    from mlx_lm.models.cache import make_prompt_cache

    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=8,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=256,
    )
    mx.random.seed(0)
    model = llama.Model(args)
    outs = []
    calls = []
    for swapped in (False, True):
        cache = make_prompt_cache(model)
        model(mx.array([list(range(10, 70))]), cache=cache)

        def counting(*a, **kw):  # (proves the model went through it)
            calls.append(1)
            return attention.attend(*a, **kw)

        with attention.unfused(swapped):
            if swapped:
                mx.fast.scaled_dot_product_attention = counting
            outs.append(model(mx.array([[7, 8, 9, 10, 11]]), cache=cache))
    assert calls, "the model never called the swapped attention"
    assert mx.allclose(outs[0], outs[1], atol=1e-3).item()
    assert mx.argmax(outs[0], axis=-1).tolist() == mx.argmax(outs[1], axis=-1).tolist()
