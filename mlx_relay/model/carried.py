"""What some families' layers take besides h, carried with it between ranks.

talkie's blocks each add the normed token embedding (`e_x`, with a learned gain);
rwkv7's layers after the first mix in the first layer's values (`v_first`); Kimi K3's
layers mix h with the outputs of earlier blocks of layers (attention residuals: one
stored hidden state per block of `attn_res_block_size` layers so far, and its final
norm reads a mix of them all); Hunyuan-Large's layers share keys and values in groups
of `cla_share_factor` (cross-layer attention: the first layer of a group projects
them, the others reuse them, within the step). Each is made on a rank and may be read
by layers on later ranks, so it travels with h, folded into the payload's width as
gemma3n's AltUp streams are (altup.py): (batch, tokens, width), h first, then the
carried states in order. Kimi K3's state grows by one hidden state at each block
start, so a hop after more blocks is wider; Hunyuan's carries the group's keys and
values only where a hop parts a group. DeepSeek V4.1's hyper-connection streams and
the state its layers share are laid out in deepseek_v4.py.

Each family is a `Carrier`, which its adapter names (families/): rank 0 folds the
embedding (`start`), every rank runs its layers on the folded state as the family's
forward does (`run_layers`), and the head reads the h the final norm gets (`final`);
`width_after` says how wide the state is after some layers (what rank 0 posts the
return's receive for). Folding and unfolding only move values, so a stage computes
exactly what the whole model computes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlx_relay.model import deepseek_v4

MaskFor = Callable[[Any], Any]


def _fold(parts: list[mx.array]) -> mx.array:
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


def _unfold(x: mx.array, width: int, *widths: int) -> list[mx.array]:
    """(batch, tokens, total) -> arrays (batch, tokens, width), then of `widths` each if
    given, else of `width` each."""
    if x.shape[-1] == width:
        return [x]
    widths = widths or (width,) * (x.shape[-1] // width - 1)
    bounds = [0, width]
    for w in widths:
        bounds.append(bounds[-1] + w)
    return [mx.contiguous(x[..., a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]


class Carrier:
    """How one family's layers run on a folded state. The defaults: the state is h."""

    def start(self, inner: Any, h: mx.array) -> mx.array:
        """The state before the first layer, from the embedding h."""
        return h

    def width_after(self, inner: Any, layers_done: int, width: int) -> int:
        """The state's width after the model's first `layers_done` layers, where one of
        `width` entered them."""
        return width

    def probe_state(self, inner: Any, first: int, h: mx.array) -> mx.array:
        """Zeros of the state entering layer `first` in a first step of h's tokens, for
        a probe run (h: zeros of the hidden state's shape)."""
        return mx.zeros((*h.shape[:2], self.width_after(inner, first, h.shape[-1])), h.dtype)

    def final(self, inner: Any, x: mx.array) -> mx.array:
        """The h the final norm reads, from the state after the last layer."""
        return x

    def run_layers(
        self,
        inner: Any,
        first: int,
        layers: list[Any],
        x: mx.array,
        caches: list[Any],
        mask_for: MaskFor,
    ) -> mx.array:
        """The layers (the model's from index `first` on) on a folded state, each called
        as the family's forward calls it."""
        raise NotImplementedError


class _Paired(Carrier):
    """h and a companion of its width (talkie's e_x, rwkv7's v_first)."""

    def start(self, inner: Any, h: mx.array) -> mx.array:
        return _fold([h, h])

    def probe_state(self, inner: Any, first: int, h: mx.array) -> mx.array:
        return _fold([h, h])

    def final(self, inner: Any, x: mx.array) -> mx.array:
        return _unfold(x, x.shape[-1] // 2)[0]


class Talkie(_Paired):
    """Every block adds the normed embedding (its forward norms it, then keeps it)."""

    def run_layers(
        self,
        inner: Any,
        first: int,
        layers: list[Any],
        x: mx.array,
        caches: list[Any],
        mask_for: MaskFor,
    ) -> mx.array:
        h, embedding = _unfold(x, x.shape[-1] // 2)
        for layer, cache in zip(layers, caches, strict=True):
            h = layer(embedding, h, mask_for(cache), cache)
        return _fold([h, embedding])


class Rwkv7(_Paired):
    """Every layer after the first mixes in the first layer's values (zeros before it:
    layer 0 makes v_first and reads none); no masks, its state is recurrent."""

    def start(self, inner: Any, h: mx.array) -> mx.array:
        return _fold([h, mx.zeros_like(h)])

    def run_layers(
        self,
        inner: Any,
        first: int,
        layers: list[Any],
        x: mx.array,
        caches: list[Any],
        mask_for: MaskFor,
    ) -> mx.array:
        h, companion = _unfold(x, x.shape[-1] // 2)
        if not layers:
            return x
        # (batch, tokens, heads, head_dim), heads x head_dim = hidden
        shape = (*companion.shape[:2], layers[0].attn.num_heads, layers[0].attn.head_dim)
        v_first = companion.reshape(shape)
        for layer, cache in zip(layers, caches, strict=True):
            h, v_first = layer(h, v_first, cache)
        return _fold([h, v_first.reshape(companion.shape)])


class KimiK3(Carrier):
    """Attention residuals: h, then one state per block of attn_res_block_size layers
    begun so far; the final norm reads their mix with h (the output mix)."""

    def width_after(self, inner: Any, layers_done: int, width: int) -> int:
        if not inner.use_attn_res:
            return width
        args = inner.args
        return (1 + math.ceil(layers_done / args.attn_res_block_size)) * args.hidden_size

    def final(self, inner: Any, x: mx.array) -> mx.array:
        h, *raw = _unfold(x, inner.args.hidden_size)
        if not inner.use_attn_res:
            return h
        from mlx_lm.models.kimi_k3 import _attn_res_mix

        if inner._output_res_w_eff is None:  # (as its forward caches it)
            inner._output_res_w_eff = inner.output_attn_res_norm.weight.astype(
                mx.float32
            ) * inner.output_attn_res_proj.weight.reshape(-1)
        blocks = self._blocks(inner, raw)
        return _attn_res_mix(blocks, h, inner._output_res_w_eff, inner.args.rms_norm_eps, True)

    def run_layers(
        self,
        inner: Any,
        first: int,
        layers: list[Any],
        x: mx.array,
        caches: list[Any],
        mask_for: MaskFor,
    ) -> mx.array:
        h, *raw = _unfold(x, inner.args.hidden_size)
        blocks = self._blocks(inner, raw) if inner.use_attn_res else None
        for layer, cache in zip(layers, caches, strict=True):
            h, blocks = layer(h, mask=mask_for(cache), cache=cache, blocks=blocks)
        if blocks is None or blocks.raw is None:
            return h
        return _fold([h, *(blocks.raw[i] for i in range(blocks.raw.shape[0]))])

    @staticmethod
    def _blocks(inner: Any, raw: list[mx.array]) -> Any:
        """Its ResidualBlocks holding these blocks' states, their inverse RMS computed
        as its own pipeline's receiving rank computes them."""
        from mlx_lm.models.kimi_k3 import ResidualBlocks

        blocks = ResidualBlocks(inner.args.rms_norm_eps)
        if raw:
            blocks.raw = mx.stack(raw)
            xf = blocks.raw.astype(mx.float32)
            blocks.inv_rms = mx.rsqrt((xf * xf).mean(axis=-1) + inner.args.rms_norm_eps)
        return blocks


class Hunyuan(Carrier):
    """Cross-layer attention: a group's first layer projects keys and values, the others
    reuse them; carried after h where a hop parts a group."""

    def width_after(self, inner: Any, layers_done: int, width: int) -> int:
        args = inner.args
        return args.hidden_size + (2 * self._kv_width(args) if self._open(args, layers_done) else 0)

    def run_layers(
        self,
        inner: Any,
        first: int,
        layers: list[Any],
        x: mx.array,
        caches: list[Any],
        mask_for: MaskFor,
    ) -> mx.array:
        args = inner.args
        h, *shared = _unfold(x, args.hidden_size, self._kv_width(args), self._kv_width(args))
        kv_states = tuple(shared) or None
        for i, (layer, cache) in enumerate(zip(layers, caches, strict=True), start=first):
            if not args.use_cla or i % args.cla_share_factor == 0:
                kv_states = None
            h, kv_states = layer(h, mask_for(cache), cache, kv_states)
        if self._open(args, first + len(layers)):
            return _fold([h, *kv_states])
        return h

    @staticmethod
    def _open(args: Any, layers_done: int) -> bool:
        """Whether a group is still open after the model's first `layers_done` layers:
        its next layer reuses keys and values made before."""
        return (
            bool(args.use_cla)
            and layers_done % args.cla_share_factor != 0
            and layers_done < args.num_hidden_layers
        )

    @staticmethod
    def _kv_width(args: Any) -> int:
        """The width of its shared keys or values (before the heads split)."""
        return args.num_key_value_heads * (args.hidden_size // args.num_attention_heads)


class DeepSeekV4(Carrier):
    """Hyper-connection streams and the state its layers share: deepseek_v4.py. The
    last layer's rank collapses the streams, so the final norm reads the state as is."""

    def start(self, inner: Any, h: mx.array) -> mx.array:
        return deepseek_v4.start(inner.args, h)

    def width_after(self, inner: Any, layers_done: int, width: int) -> int:
        return deepseek_v4.width_after(inner.args, layers_done, width)

    def probe_state(self, inner: Any, first: int, h: mx.array) -> mx.array:
        return deepseek_v4.probe_state(inner.args, first, h)

    def run_layers(
        self,
        inner: Any,
        first: int,
        layers: list[Any],
        x: mx.array,
        caches: list[Any],
        mask_for: MaskFor,
    ) -> mx.array:
        return deepseek_v4.run_layers(inner, first, layers, x, caches)  # (no masks)
