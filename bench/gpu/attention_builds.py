"""Which attention shapes make CUDA build a kernel of their own: each shape's first call
and a second one, in order, in one process.

    CUDA_CACHE_PATH=$(mktemp -d) python3 bench/gpu/attention_builds.py [capacity]
    CUDA_CACHE_DISABLE=1 python3 bench/gpu/attention_builds.py

MLX's CUDA backend runs attention through cuDNN, which generates a kernel for a graph
and has the driver compile it; the driver caches what it compiled on disk (~/.nv), so a
fresh machine pays for each kernel the first time (~0.5 s on an H200) and later
processes do not. With an empty cache, a first call far slower than the second marks
a kernel no shape before it needed: the shapes a load's warm-up must run (warmup.py).
The shapes are the Llama-3-8B shape's (32 query heads, 8 KV heads, 128 wide, bf16),
keys and values a view of a cache buffer as mlx-lm's KV cache gives them.
"""

from __future__ import annotations

import sys
import time

import mlx.core as mx

HEADS, KV_HEADS, WIDTH = 32, 8, 128
SHAPES = [  # (what it stands for, queries, keys, the cache buffer's positions, mask)
    ("a warm-up chunk", 512, 1024, 1024, "causal"),
    ("a warm-up chunk, 4,096 keys", 512, 4096, 4096, "causal"),
    ("the warm-up's odd chunk", 257, 4096, 4096, "causal"),
    ("a prompt's chunk", 512, 3584, 3840, "causal"),
    ("a prompt's odd last chunk", 223, 3807, 3840, "causal"),
    ("another", 226, 3810, 3840, "causal"),
    ("another", 240, 3824, 3840, "causal"),
    ("one query, odd key count", 1, 4097, 4352, None),
    ("one query, even key count", 1, 3808, 3840, None),
    ("one query, even, causal mask", 1, 3808, 3840, "causal"),
    ("two queries", 2, 3809, 3840, "causal"),
    ("sixteen queries", 16, 3823, 3840, "causal"),
    ("an odd chunk past the warm-up's", 257, 4353, 4608, "causal"),
]
# `capacity`: one-query steps, telling the key count's parity apart from the cache
# buffer's size (mlx-lm's KV cache grows 256 positions at a time; cuDNN is given the
# whole buffer and the count, SEQ_LEN_KV, at run time).
CAPACITY = [
    ("odd count", 1, 4097, 4352, None),
    ("even count, same buffer", 1, 4098, 4352, None),
    ("odd count, a buffer of 3,840", 1, 3809, 3840, None),
    ("even count, that buffer", 1, 3810, 3840, None),
    ("another count, that buffer", 1, 3601, 3840, None),
    ("a buffer of 4,096", 1, 4001, 4096, None),
    ("a buffer of 1,024", 1, 1001, 1024, None),
    ("a buffer of 8,192", 1, 8001, 8192, None),
    ("a buffer of 3,584", 1, 3501, 3584, None),
]


def cached_view(positions: int, used: int) -> mx.array:
    return mx.random.normal((1, KV_HEADS, positions, WIDTH)).astype(mx.bfloat16)[:, :, :used]


def timed(q: mx.array, k: mx.array, v: mx.array, mask: str | None) -> float:
    t0 = time.perf_counter()
    mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=WIDTH**-0.5, mask=mask))
    return time.perf_counter() - t0


def main() -> None:
    for label, queries, keys, positions, mask in CAPACITY if "capacity" in sys.argv else SHAPES:
        q = mx.random.normal((1, HEADS, queries, WIDTH)).astype(mx.bfloat16)
        k, v = cached_view(positions, keys), cached_view(positions, keys)
        mx.eval(q, k, v)
        first, again = timed(q, k, v, mask), timed(q, k, v, mask)
        shape = f"q {queries} k {keys} ({positions}) {mask or 'no mask'}"
        print(f"{label:<34} {shape:<30} first {first * 1e3:7.1f} ms, again {again * 1e3:5.1f}")


if __name__ == "__main__":
    main()
