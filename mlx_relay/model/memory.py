"""Memory figures a rank reports about itself (side channel, Status), and whether a
shard's weights fit before any is loaded."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import mlx.core as mx
import psutil

MEMORY_LIMIT_ENV = "MLX_RELAY_MEMORY_LIMIT"  # cap on the memory this rank may use, e.g. 8GB
_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_UNITS = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30}


class ShardTooBig(ValueError):
    """The weights of a rank's layers exceed the memory it may use."""


def stats() -> dict[str, int]:
    return {
        "active_memory": int(mx.get_active_memory()),
        "peak_memory": int(mx.get_peak_memory()),
        "rss": int(psutil.Process().memory_info().rss),
        "free_memory": int(psutil.virtual_memory().available),
    }


def shard_nbytes(path: Path, start: int, end: int, *, ends: bool = False) -> int:
    """Bytes of layers [start, end), plus with `ends` every tensor outside the layers
    (embedding, final norm, LM head), from the safetensors headers: no weight is read."""
    total = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            tensors = json.loads(fh.read(size))
        for name, info in tensors.items():
            if name == "__metadata__":
                continue
            match = _LAYER_NAME.search(name)
            if (match and start <= int(match.group(1)) < end) or (ends and not match):
                first, last = info["data_offsets"]
                total += last - first
    return total


def memory_limit() -> int | None:
    """MLX_RELAY_MEMORY_LIMIT in bytes ('8GB', '512MiB', '1000000'), or None if unset."""
    raw = os.environ.get(MEMORY_LIMIT_ENV, "").strip().upper().removesuffix("B")
    if not raw:
        return None
    number = raw.rstrip("KMGTI")
    try:
        return int(float(number) * _UNITS[raw[len(number) :]])
    except (KeyError, ValueError):
        raise ValueError(
            f"{MEMORY_LIMIT_ENV}={os.environ[MEMORY_LIMIT_ENV]!r} is not a size"
        ) from None


def check_fits(path: Path, start: int, end: int, *, ends: bool = False) -> None:
    """Refuse a shard whose weights exceed what this rank may use, before loading any."""
    need = shard_nbytes(path, start, end, ends=ends)
    available = psutil.virtual_memory().available
    limit = memory_limit()
    if limit is not None and limit < available:
        allowed, why = limit, f"{MEMORY_LIMIT_ENV}={os.environ[MEMORY_LIMIT_ENV]}"
    else:
        allowed, why = available, "memory available on this machine"
    if need > allowed:
        what = f"layers [{start}, {end})" + (" with embedding and head" if ends else "")
        raise ShardTooBig(
            f"{what} need {_size(need)} of weights but this rank may use "
            f"{_size(allowed)} ({why}); use more ranks or a smaller model"
        )


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"
