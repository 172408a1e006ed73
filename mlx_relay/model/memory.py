"""Memory figures a rank reports about itself (side channel, Status), and whether a
shard fits before any of it is loaded: its weights, and the caches of `--max-active`
sequences of `--max-context` tokens each, plus headroom.

Cache sizes come from the model's config, by the kind of cache each layer keeps (as
mlx-lm makes them): a plain KV cache grows by 2 x KV heads x head dim x dtype bytes per
token (in steps of 256 positions), a sliding-window layer stops at its window. A model
whose caches are of another kind (state-space layers, linear attention) cannot be
estimated this way: each rank measures them on its lazily loaded shard instead
(`check_measured`: the shapes of a probe step's graph, nothing computed) and checks
again; a worker's layout reaches rank 0's run-time check in its stats.

On a Mac, memory that runs out kills the process or stalls the GPU, so a rank refuses
at load what would not fit, and rank 0 admits at run time only what fits what each
rank has left (`admission_shortfall`).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import psutil
from mlx.utils import tree_flatten

from mlx_relay.model import checkpoint, families, sharding
from mlx_relay.sizes import parse_size

log = logging.getLogger("mlx_relay.memory")

MEMORY_LIMIT_ENV = "MLX_RELAY_MEMORY_LIMIT"  # cap on the memory this rank may use, e.g. 8GB


HEADROOM = 0.10  # beyond weights + caches: activations, MLX's allocator, batch merges
# At run time what is in use is measured, transients aside: a smaller reserve suffices.
RUNTIME_RESERVE = 0.025
CACHE_STEP = 256  # mlx-lm's KV caches grow by this many positions at a time
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_TORCH_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
# What a family's caches are, where its config alone gives their size, is its adapter's
# `kv_cache` (families/): "attention" (plain KV caches, or sliding windows the config
# tells), "mla" (one latent + one rotary key per position), "mla_indexer" (MLA plus a
# sparse indexer, whose CacheList also keeps one indexer key per position, stored as keys
# and as values).


class ShardTooBig(ValueError):
    """The weights of a rank's layers (and its caches) exceed the memory it may use."""


class CacheUnknown(ValueError):
    """The model keeps caches whose size this module cannot tell from its config."""


@dataclass(frozen=True)
class Plan:
    """What each rank must hold caches for: built once from the command line by `serve`
    (coordinator/config.py holds rank 0's), and given to this module once (`configure`)
    for the loads' checks on every rank."""

    max_active: int = 0  # 0: the caches are not checked (a bare Pipeline, as in tests)
    max_context: int = 0  # 0: the model's own context
    # --kv-bits (0: plain caches), --kv-group-size, --quantized-kv-start: rank 0 sends
    # them to every rank in the load document (kv_quantization).
    kv_bits: int = 0
    kv_group_size: int = 64
    quantized_kv_start: int = 0

    def kv_quantization(self) -> dict[str, int] | None:
        """The load document's setting for quantized KV caches (sharding.KVQuant)."""
        if not self.kv_bits:
            return None
        return {
            "bits": self.kv_bits,
            "group_size": self.kv_group_size,
            "start": self.quantized_kv_start,
        }


_plan = Plan()


def configure(new: Plan) -> None:
    """This rank's plan (`--max-active`, `--max-context`, the KV quantization options),
    for every later `check_fits` and load on it."""
    global _plan
    if new.max_context < 0:
        raise ValueError("--max-context must be >= 0 (0: the model's context)")
    _plan = new


def plan() -> Plan:
    return _plan


def sequence_bound(model_context: int, max_context: int) -> int:
    """The most tokens (prompt + generated) one sequence may hold: `max_context`
    (--max-context), never more than the model's context (0: no bound known)."""
    if max_context and model_context:
        return min(max_context, model_context)
    return max_context or model_context


def stats() -> dict[str, int]:
    return {
        "active_memory": int(mx.get_active_memory()),
        "cache_memory": int(mx.get_cache_memory()),  # freed, kept by MLX for reuse
        "peak_memory": int(mx.get_peak_memory()),
        "rss": int(psutil.Process().memory_info().rss),
        "free_memory": int(psutil.virtual_memory().available),
        "memory_limit": memory_limit() or 0,
    }


def headroom(stats: dict[str, Any]) -> int:
    """Bytes a rank may still allocate, from its `stats()` (its own or a heartbeat's)."""
    free = int(stats.get("free_memory", 0)) + int(stats.get("cache_memory", 0))
    limit = int(stats.get("memory_limit", 0))
    if limit:
        free = min(free, limit - int(stats.get("active_memory", 0)))
    return free


# --- cache sizes, from the config -----------------------------------------------------


@functools.lru_cache(maxsize=32)
def _read_config(path: str) -> dict[str, Any]:
    with open(Path(path) / "config.json") as f:
        config = json.load(f)
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def model_context(path: Path) -> int:
    """The model's context length from its config (0 if it says none)."""
    return int(_read_config(str(path)).get("max_position_embeddings") or 0)


@functools.lru_cache(maxsize=32)
def _layer_caches(path: str, start: int, end: int) -> tuple[int, tuple[int | None, ...]]:
    """(bytes per cached position of one layer, each layer's window or None for full).

    Raises CacheUnknown for a model whose caches are not plain, sliding-window or MLA KV.
    """
    config = _read_config(path)
    family = str(config.get("model_type", ""))
    adapter = families.adapter_for(family)
    layer_types = config.get("layer_types")
    chunk = _chunk_window(path, config)
    if not (chunk or adapter.kv_cache or isinstance(layer_types, list) or _plain_caches(family)):
        raise CacheUnknown(f"model_type {family!r} makes caches of its own kind")
    try:
        per_position = _position_values(adapter.kv_cache, config) * _dtype_bytes(Path(path), config)
    except (KeyError, TypeError, ValueError) as e:  # (a config without what it reads)
        raise CacheUnknown(f"model_type {family!r}: {e}") from None
    window = config.get("sliding_window")
    # KV-shared layers (gemma4's, gemma3n's) read the caches of layers they reuse
    shared_from = sharding.count_layers(config) - sharding.kv_shared_layers(config)
    windows: list[int | None] = []
    for layer in range(start, end):
        if layer >= shared_from:
            continue
        if isinstance(layer_types, list):
            kind = layer_types[layer] if layer < len(layer_types) else "?"
            if kind not in ("full_attention", "sliding_attention"):
                raise CacheUnknown(f"layer {layer} is {kind!r}, not attention")
            windows.append(int(window) if kind == "sliding_attention" and window else None)
        elif chunk and (layer + 1) % 4:  # (llama 4: every 4th layer attends to all)
            windows.append(chunk)
        elif adapter.sliding_pattern and config.get("sliding_window_pattern") and window:
            pattern = int(config["sliding_window_pattern"])
            windows.append(None if layer % pattern == pattern - 1 else int(window))
        else:
            windows.append(None)
    return per_position, tuple(windows)


def _chunk_window(path: str, config: dict[str, Any]) -> int:
    """Positions a chunked-attention layer of Llama 4 holds at most (0: not Llama 4):
    its chunk, plus what one step adds before the cache drops what is out of it."""
    model_type = sharding.read_config(Path(path)).get("model_type")  # (not its text's)
    if not families.adapter_for(str(model_type)).chunked_attention:
        return 0
    chunk = int(config.get("attention_chunk_size") or 0)
    return chunk + CACHE_STEP if chunk else 0


def _position_values(kind: str | None, config: dict[str, Any]) -> int:
    """Values one layer caches per position: keys and values of every KV head, or for
    MLA (DeepSeek V3) the compressed latent and the rotary key, as mlx-lm keeps them
    (`kind`: the family's adapter's kv_cache)."""
    if kind == "mla":
        return int(config["kv_lora_rank"]) + int(config["qk_rope_head_dim"])
    if kind == "mla_indexer":
        latent = int(config["kv_lora_rank"]) + int(config["qk_rope_head_dim"])
        return latent + 2 * int(config["index_head_dim"])
    if "kv_lora_rank" in config:
        raise ValueError("MLA attention of a family whose cache layout is not known here")
    heads = int(config.get("num_attention_heads") or 0)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or (int(config.get("hidden_size", 0)) // max(heads, 1)))
    if not (kv_heads and head_dim):
        raise ValueError("no KV heads or head dim in its config")
    return 2 * kv_heads * head_dim


def _plain_caches(family: str) -> bool:
    """An mlx-lm model that makes no caches of its own keeps a plain KVCache per layer."""
    model_class = families.mlx_lm_model_class(family)  # (None: nothing known of its caches)
    return model_class is not None and not hasattr(model_class, "make_cache")


def _dtype_bytes(path: Path, config: dict[str, Any]) -> int:
    """Bytes per cached value: the dtype the model computes in (that of its float weights)."""
    seen: dict[str, int] = {}
    for tensor in checkpoint.tensors(path).values():
        if tensor.dtype in _DTYPE_BYTES:
            seen[tensor.dtype] = seen.get(tensor.dtype, 0) + tensor.nbytes
    if seen:
        return _DTYPE_BYTES[max(seen, key=seen.__getitem__)]
    return _TORCH_DTYPE_BYTES.get(str(config.get("torch_dtype")), 2)


def cache_nbytes(path: Path, start: int, end: int, tokens: int) -> int:
    """Bytes the caches of layers [start, end) take for one sequence of `tokens` tokens:
    from the config, or for caches of a model's own kind as measured on the loaded shard
    (`measure_caches`); CacheUnknown if neither tells."""
    try:
        per_position, windows = _layer_caches(str(path), start, end)
    except CacheUnknown:
        layout = _measured.get((str(path), start, end))
        if layout is None:
            raise
        return layout_nbytes(layout, tokens)
    held = math.ceil(tokens / CACHE_STEP) * CACHE_STEP
    full = per_position  # a full-attention layer's bytes per position
    config = _read_config(str(path))
    # (an indexer's CacheLists stay as they are)
    quantized = families.adapter_for(str(config.get("model_type"))).kv_cache != "mla_indexer"
    if _plan.kv_bits and quantized and tokens > _plan.quantized_kv_start:
        # Quantized (as QuantizedKVCache): each value packed into kv_bits bits, plus a
        # scale and a bias per group of kv_group_size values, in the model's dtype.
        dtype = _dtype_bytes(Path(path), config)
        values = per_position // dtype
        full = values * _plan.kv_bits // 8 + 2 * dtype * values // _plan.kv_group_size
    return sum(full * held if w is None else per_position * min(held, w) for w in windows)


def bytes_per_token(path: Path, ranges: list[tuple[int, int]]) -> float:
    """The most cache bytes a token takes on any rank (each holding the layers of its
    range in `ranges`), over a long sequence (a sliding window's cap then counts as it
    would for one sequence). CacheUnknown if a rank's caches are not known."""
    sample = 64 * CACHE_STEP
    return max(cache_nbytes(path, s, e, sample) / sample for s, e in ranges)


# A shard's caches as measured (`measure_caches`): per cache, (bytes whatever the
# length, bytes per position, the most positions it keeps or 0 for all of them).
CacheLayout = list[tuple[int, int, int]]
_measured: dict[tuple[str, int, int], CacheLayout] = {}
# A probe step's lengths: whole cache steps, so that a cache growing by whole steps or
# keeping one row per group of positions (a compressed cache) shows its rate.
_PROBE_TOKENS = (2 * CACHE_STEP, 4 * CACHE_STEP)


def measure_caches(shard: sharding.Shard) -> CacheLayout:
    """The layout of the caches the shard's layers make, read off a probe step built at
    two lengths and never computed: the shapes of a lazy graph's arrays are known
    before anything runs, so no weight is read (unless the family's own code reads a
    value while building: then this runs like a prompt of that length)."""
    sizes = []
    for tokens in _PROBE_TOKENS:
        caches = sharding.new_caches(shard)
        sharding.run_layers(shard, sharding.probe_input(shard, tokens), caches)
        flat = sharding.flat_caches(caches)
        sizes.append([_state_nbytes(c) for c in flat])
    short, long = _PROBE_TOKENS
    layout: CacheLayout = []
    for cache, small, large in zip(flat, *sizes, strict=True):
        per_position = max(0, (large - small) // (long - short))
        window = cache.max_size if isinstance(cache, sharding.RotatingKVCache) else 0
        layout.append((max(0, small - per_position * short), per_position, int(window or 0)))
    return layout


def _state_nbytes(cache: Any) -> int:
    return sum(a.nbytes for _, a in tree_flatten(cache.state) if isinstance(a, mx.array))


def layout_nbytes(layout: CacheLayout, tokens: int) -> int:
    """Bytes of a measured layout's caches for one sequence of `tokens` tokens."""
    held = math.ceil(tokens / CACHE_STEP) * CACHE_STEP
    return sum(
        fixed + per_position * (min(held, window) if window else held)
        for fixed, per_position, window in layout
    )


def check_measured(
    path: Path, start: int, end: int, shard: sharding.Shard, *, ends: bool = False
) -> CacheLayout | None:
    """After a lazy load (no weight read yet), for a model whose caches the config does
    not tell: measure them, keep the layout for `cache_nbytes`, and check the shard
    again with them (ShardTooBig). Returns the layout, None where the config told."""
    try:
        _layer_caches(str(path), start, end)
        return None
    except CacheUnknown:
        pass
    try:
        layout = measure_caches(shard)
    except Exception as e:  # noqa: BLE001 - a family's probe may not run: weights only
        log.warning("layers [%d, %d): caches not measured: %s (weights only)", start, end, e)
        return None
    register_layout(path, start, end, layout)
    check_fits(path, start, end, ends=ends)
    return layout


def register_layout(path: Path, start: int, end: int, layout: CacheLayout) -> None:
    """A rank's measured layout (its own, or a worker's from its LOADED message)."""
    _measured[(str(path), start, end)] = [tuple(int(v) for v in entry) for entry in layout]


def shard_nbytes(path: Path, start: int, end: int, *, ends: bool = False, tensor: int = 1) -> int:
    """Bytes of layers [start, end), plus with `ends` every tensor outside the layers
    (embedding, final norm, LM head; a VLM's vision tower and projector), from the
    safetensors headers: no weight is read. `tensor`: the layers are split across that
    many ranks (tensor_split.py), each holding about 1/tensor of them."""
    layers = outside = 0
    second = sharding.second_list_from(_read_config(str(path)))
    for name, nbytes in checkpoint.tensor_bytes(path).items():
        layer = checkpoint.layer_of(name, second)
        if layer is not None and start <= layer < end:
            layers += nbytes
        elif ends and layer is None:
            outside += nbytes
    return math.ceil(layers / tensor) + outside


def memory_limit() -> int | None:
    """MLX_RELAY_MEMORY_LIMIT in bytes ('8GB', '512MiB', '1000000'), or None if unset."""
    raw = os.environ.get(MEMORY_LIMIT_ENV, "").strip()
    if not raw:
        return None
    try:
        return parse_size(raw)
    except ValueError:
        raise ValueError(f"{MEMORY_LIMIT_ENV}={raw!r} is not a size") from None


def shard_need(path: Path, start: int, end: int, *, ends: bool = False) -> int:
    """Bytes a shard needs as check_fits counts them: its weights, with the caches of
    `--max-active` sequences of `--max-context` tokens and HEADROOM where they are known."""
    weights = shard_nbytes(path, start, end, ends=ends)
    if not _plan.max_active:
        return weights
    context = sequence_bound(model_context(path), _plan.max_context)
    try:
        caches = _plan.max_active * cache_nbytes(path, start, end, context)
    except CacheUnknown:
        return weights
    return int((weights + caches) * (1 + HEADROOM))


def short_rank(path: Path, ranges: list[tuple[int, int]], rooms: list[int | None]) -> int | None:
    """The first rank whose shard (rank 0's with the embedding and head) needs more than
    the memory it has (`rooms`, bytes: each rank's `headroom`; None: not known)."""
    for rank, (start, end) in enumerate(ranges):
        room = rooms[rank] if rank < len(rooms) else None
        if room is not None and shard_need(path, start, end, ends=rank == 0) > room:
            return rank
    return None


def check_fits(path: Path, start: int, end: int, *, ends: bool = False, tensor: int = 1) -> None:
    """Refuse a shard whose weights, with the caches of `--max-active` sequences of
    `--max-context` tokens and HEADROOM, exceed what this rank may use; before loading any.
    `tensor`: the layers are split across that many ranks (each keeps 1/tensor of the
    layers' weights and of their caches' heads)."""
    weights = shard_nbytes(path, start, end, ends=ends, tensor=tensor)
    available = psutil.virtual_memory().available
    limit = memory_limit()
    if limit is not None and limit < available:
        allowed, why = limit, f"{MEMORY_LIMIT_ENV}={os.environ[MEMORY_LIMIT_ENV]}"
    else:
        allowed, why = available, "memory available on this machine"
    what = f"layers [{start}, {end})" + (" with embedding and head" if ends else "")
    if weights > allowed:
        raise ShardTooBig(
            f"{what} need {size_text(weights)} of weights but this rank may use "
            f"{size_text(allowed)} ({why}); use more ranks or a smaller model"
        )
    if not _plan.max_active:
        return
    context = sequence_bound(model_context(path), _plan.max_context)
    try:
        caches = _plan.max_active * cache_nbytes(path, start, end, context) // tensor
    except CacheUnknown as e:  # (check_measured measures them once loaded)
        log.info("%s: caches checked once loaded: %s", what, e)
        return
    need = int((weights + caches) * (1 + HEADROOM))
    if need > allowed:
        raise ShardTooBig(
            f"{what} need {size_text(need)}: {size_text(weights)} of weights + {size_text(caches)} of "
            f"caches for --max-active {_plan.max_active} sequences of --max-context "
            f"{context:,} tokens + {HEADROOM:.0%} headroom, but this rank may use "
            f"{size_text(allowed)} ({why}); lower --max-active or --max-context, or use more "
            "ranks or a smaller model"
        )
    log.info(
        "%s: %s of weights + %s of caches (%d x %d tokens) fit in %s",
        what,
        size_text(weights),
        size_text(caches),
        _plan.max_active,
        context,
        size_text(allowed),
    )


def check_draft_fits(path: Path, streams: int, context: int) -> None:
    """Refuse a draft model whose weights, with the caches of `streams` speculating
    sequences of `context` tokens and HEADROOM, exceed what rank 0 may still allocate
    beside its shard of the served model; before loading any of it. (Rank 0 holds the
    draft whole; its caches grow with each speculating stream, at most
    `--draft-max-streams` of them.)"""
    layers = sharding.count_layers(_read_config(str(path)))
    weights = shard_nbytes(path, 0, layers, ends=True)
    try:
        caches = streams * cache_nbytes(path, 0, layers, context) if context else 0
    except CacheUnknown:
        caches = 0
    need = int((weights + caches) * (1 + HEADROOM))
    room = headroom(stats())
    if need > room:
        limit = f" ({MEMORY_LIMIT_ENV}={os.environ[MEMORY_LIMIT_ENV]})" if memory_limit() else ""
        raise ShardTooBig(
            f"the draft model {path.name} needs {size_text(need)}: {size_text(weights)} of weights + "
            f"{size_text(caches)} of caches for --draft-max-streams {streams} sequences of "
            f"{context:,} tokens + {HEADROOM:.0%} headroom, but rank 0 has {size_text(room)} "
            f"left beside its shard{limit}; use a smaller draft, fewer --draft-max-streams, "
            "a lower --max-context, or --draft ngram"
        )
    log.info(
        "draft model %s: %s fits in rank 0's %s left", path.name, size_text(need), size_text(room)
    )


def admission_shortfall(
    path: Path,
    ranges: list[tuple[int, int]],
    rank_stats: dict[int, dict[str, Any]],
    tokens: int,
    running: list[tuple[int, int]],
    parked: list[int],
    fingerprint: str = "",
) -> str:
    """Why a new sequence of `tokens` tokens (prompt + max_tokens) would not fit now
    ('' if it would).

    `rank_stats`: each rank's latest `stats()`; `running`: (tokens cached now, tokens at
    most) of each running sequence, whose caches may still grow that far; `parked`: the
    tokens of each parked prompt cache, memory that is given back when its slot is taken.
    The new caches and that growth must fit in what each rank has left, less
    RUNTIME_RESERVE of its allowance. A worker's stats may hold the layout of caches it
    measured at load (`check_measured`), taken where its model's `fingerprint` is this one.
    """
    for rank, (start, end) in enumerate(ranges):
        figures = rank_stats.get(rank)
        if not figures:
            continue
        measured = figures.get("cache_layout")  # (a worker's, measured at its load)
        if measured and (measured["fingerprint"], *measured["layers"]) == (fingerprint, start, end):
            register_layout(path, start, end, measured["layout"])
        try:
            need = cache_nbytes(path, start, end, tokens)
            growth = sum(
                cache_nbytes(path, start, end, most) - cache_nbytes(path, start, end, now)
                for now, most in running
            )
            reclaimable = sum(cache_nbytes(path, start, end, n) for n in parked)
        except CacheUnknown:
            return ""
        allowance = int(figures.get("memory_limit") or 0) or int(figures.get("free_memory", 0))
        spare = headroom(figures) + reclaimable - growth - int(RUNTIME_RESERVE * allowance)
        if need > spare:
            return (
                f"rank {rank} has {size_text(max(spare, 0))} left for new caches and this "
                f"sequence of {tokens:,} tokens needs {size_text(need)}"
            )
    return ""


def size_text(n: float) -> str:
    """Bytes for a person: '512 B', '34.6 MB', '1.2 GB'."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"
