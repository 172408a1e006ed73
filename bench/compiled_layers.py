"""Does compiling a decoder layer's cache-free parts cut the host's time a token?

    .venv/bin/python bench/compiled_layers.py MODEL_DIR [--tokens 64] [--rounds 3]

On CUDA a 70B split is host-bound: each rank spends more host time a token building and
launching the step's graph than its GPU spends computing it (bench/RESULTS.md, issue
51). `mx.compile` replaces a function's Python-built graph with a cached one (built in
C++ on each call) and fuses its elementwise ops into fewer kernels. A layer's key-value
cache update takes Python integers (its offset), so only the parts around it compile:
here the attention's input norm and q/k/v projections (`pre`) and everything after the
attention's core, o_proj, the residuals, the MLP and its norm (`post`). Llama-shaped
layers only (mlx-lm's llama `TransformerBlock`).

Rounds of each mode in turn on one loaded model (so a host's slow phase falls on all of
them alike): single-stream decode with mlx-lm's own `generate_step`, wall and process
CPU milliseconds a token, and whether the tokens equal the plain model's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.base import scaled_dot_product_attention


def compiled_call(layer) -> Callable:
    """A llama TransformerBlock's forward with its cache-free halves compiled."""
    attn = layer.self_attn

    def pre(x):
        h = layer.input_layernorm(x)
        b, n, _ = h.shape
        q = attn.q_proj(h).reshape(b, n, attn.n_heads, -1).transpose(0, 2, 1, 3)
        k = attn.k_proj(h).reshape(b, n, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = attn.v_proj(h).reshape(b, n, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return q, k, v

    def post(x, o):
        b, _, n, _ = o.shape
        h = x + attn.o_proj(o.transpose(0, 2, 1, 3).reshape(b, n, -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    cpre, cpost = mx.compile(pre), mx.compile(post)

    def call(x, mask=None, cache=None):
        q, k, v = cpre(x)
        offset = cache.offset if cache is not None else 0
        q, k = attn.rope(q, offset=offset), attn.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        o = scaled_dot_product_attention(q, k, v, cache=cache, scale=attn.scale, mask=mask)
        return cpost(x, o)

    return call


class Switch:
    """Each layer's forward, plain or compiled, chosen per round."""

    def __init__(self, model) -> None:
        self.layers = model.model.layers
        self.plain = [type(layer).__call__ for layer in self.layers]
        self.compiled = [compiled_call(layer) for layer in self.layers]
        base = type(self.layers[0])
        self.cls = type("Switched", (base,), {"__call__": lambda s, *a, **k: s._forward(*a, **k)})

    def use(self, mode: str) -> None:
        for layer, plain, comp in zip(self.layers, self.plain, self.compiled, strict=True):
            layer.__class__ = self.cls
            if mode == "plain":
                layer._forward = lambda *a, _l=layer, _p=plain, **k: _p(_l, *a, **k)
            else:
                layer._forward = comp


def decode(model, prompt: mx.array, tokens: int) -> tuple[list[int], float, float]:
    """Tokens, and wall and CPU ms a token after the first two."""
    out: list[int] = []
    for i, (t, _) in enumerate(generate_step(prompt, model, max_tokens=tokens)):
        if i == 2:
            wall, cpu = time.perf_counter(), time.process_time()
        out.append(int(t))
    n = tokens - 3
    return out, 1000 * (time.perf_counter() - wall) / n, 1000 * (time.process_time() - cpu) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default="plain,compiled")
    args = parser.parse_args()
    model, tokenizer = load(args.model)
    switch = Switch(model)
    prompt = mx.array(tokenizer.encode("Once upon a time, in a land far away, there lived"))
    modes = args.modes.split(",")
    seen: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    reference = None
    for mode in modes:  # (a first pass of each, unmeasured: compiles and warms)
        switch.use(mode)
        decode(model, prompt, 8)
    for _ in range(args.rounds):
        for mode in modes:
            switch.use(mode)
            tokens, wall, cpu = decode(model, prompt, args.tokens)
            reference = reference or tokens
            seen[mode].append((wall, cpu))
            same = "equal" if tokens == reference else "DIFFER"
            print(f"{mode:9s} wall {wall:6.2f} ms a token, CPU {cpu:6.2f} ({same})", flush=True)
    base = statistics.median(w for w, _ in seen[modes[0]])
    for mode in modes:
        wall = statistics.median(w for w, _ in seen[mode])
        cpu = statistics.median(c for _, c in seen[mode])
        print(f"{mode:9s} median wall {wall:6.2f} ms, CPU {cpu:6.2f}; speed {base / wall:.3f}x")


if __name__ == "__main__":
    main()
