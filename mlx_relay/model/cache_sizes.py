"""CUDA: a one-query attention at every KV-cache size a sequence can reach, run at load.

mlx-lm's KV cache grows its buffers 256 positions at a time, and a step's keys are a view
of the buffer. MLX's CUDA backend hands cuDNN the whole buffer with the count of keys in
use given at run time, so cuDNN's graph, and the kernel it has the driver compile, are
built for the buffer's size, not the count: measured on an H200 with an empty driver
cache (bench/gpu/attention_builds.py capacity, 2026-11-30), one-query attention over
4,097 then 4,098 keys of one 4,352-position buffer built once (982 ms, then 0.2); a
3,840-position buffer built again (638 ms), and so did a 1,024-position one (738 ms),
while 4,096-, 8,192- and 3,584-position buffers took 42-66 ms, a graph for a kernel
already compiled. A prompt's first decode steps land in whichever buffer its length
filled, so on a machine that had never compiled that kernel a ~3,800-token prompt's
first decode step took 439 ms against 9 ms for the next prompt's (rank 0's timeline,
bench/RESULTS.md). The driver caches what it compiled on disk, so this is paid once
per machine, and each new buffer size's graph (~42 ms of host time) once per process.

So on CUDA every rank, once its shard is loaded, runs one-query attention of its
layers' shape over a view of each buffer size its sequences can reach, up to
WARM_CONTEXT positions (a longer context's larger buffers are built when first met).
Elsewhere nothing is built per size (Metal's and the CPU's attention kernels do not
depend on lengths), and this does nothing.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_relay.device import on_cuda
from mlx_relay.model import memory, sharding

log = logging.getLogger("mlx_relay.load")

CACHE_STEP = 256  # positions mlx-lm's KVCache grows its buffers by
WARM_CONTEXT = 8192  # buffer sizes warmed at load, at most (~42 ms of host time each)


def buffer_sizes(context: int, step: int = CACHE_STEP, limit: int = WARM_CONTEXT) -> list[int]:
    """The KV-cache buffer sizes a sequence of up to `context` tokens passes through, up
    to `limit` (0 context: the limit)."""
    top = min(context, limit) if context else limit
    return list(range(step, top + step - 1, step)) if top > 0 else []


def attention_shape(config: dict[str, Any], tensor: int = 1) -> tuple[int, int, int] | None:
    """(query heads, key-value heads, head width) of a rank's attention for the model of
    `config` split across `tensor` ranks; None where the config does not say them plainly
    (then nothing is warmed)."""
    text = config.get("text_config") or config
    heads = text.get("num_attention_heads")
    if not isinstance(heads, int) or heads < 1:
        return None
    kv_heads = text.get("num_key_value_heads") or heads
    width = text.get("head_dim") or (text.get("hidden_size", 0) // heads)
    if not isinstance(kv_heads, int) or not isinstance(width, int) or width < 1:
        return None
    if heads % tensor or kv_heads % tensor:
        return None
    return heads // tensor, kv_heads // tensor, width


def activation_dtype(shard: sharding.Shard) -> mx.Dtype:
    """The dtype the shard's layers compute in (its caches hold it): its norms' weights'."""
    for name, value in tree_flatten(shard.model.parameters()):
        if "norm" in name and mx.issubdtype(value.dtype, mx.floating):
            return value.dtype
    return mx.bfloat16


def warm(shard: sharding.Shard, path: Path, tensor: int = 1) -> tuple[int, float]:
    """On CUDA, one-query attention of the shard's shape over every buffer size its
    sequences reach (see the module); returns (sizes run, seconds). (0, 0.0) elsewhere,
    or where the shape is not known or the shard has no layer of plain caches."""
    shape = attention_shape(shard.config, tensor)
    if not on_cuda() or shape is None or not shard.layers:
        return 0, 0.0
    heads, kv_heads, width = shape
    dtype = activation_dtype(shard)
    context = memory.sequence_bound(memory.model_context(path), memory.plan().max_context)
    started = time.monotonic()
    sizes = buffer_sizes(context)
    # (laid out as a model's queries are, (B, L, H, D) transposed: MLX keys the graph by
    # the query's strides as well; a contiguous one did not match a real step's)
    query = mx.zeros((1, 1, heads, width), dtype).transpose(0, 2, 1, 3)
    for size in sizes:
        keys = mx.zeros((1, kv_heads, size, width), dtype)[:, :, : size - 1]
        mx.eval(mx.fast.scaled_dot_product_attention(query, keys, keys, scale=width**-0.5))
    return len(sizes), time.monotonic() - started


def warm_logged(shard: sharding.Shard, path: Path, tensor: int = 1) -> None:
    """`warm`, logged where it ran."""
    sizes, seconds = warm(shard, path, tensor)
    if sizes:
        log.info("one-query attention built for %d cache sizes in %.2f s", sizes, seconds)
