"""Sizes as people write them ('8GB', '512MiB', '1000000'), in bytes.

Its own module, importing nothing, because launchers parse size options before they
check anything else: reached through model/memory.py, parsing `--memory-limit` imported
mlx and mlx-lm (and transformers through it, ~3 CPU-seconds) into every `mlx-relay
local` and `launch`, so even a refused path took seconds to say so.
"""

from __future__ import annotations

_UNITS = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30}


def parse_size(text: str) -> int:
    """A size in bytes from '8GB', '512MiB', '1000000'; ValueError if it is none."""
    raw = text.strip().upper().removesuffix("B")
    number = raw.rstrip("KMGTI")
    try:
        return int(float(number) * _UNITS[raw[len(number) :]])
    except (KeyError, ValueError):
        raise ValueError(f"{text!r} is not a size (e.g. 8GB, 512MiB, 1000000)") from None
