"""Memory figures a rank reports about itself (side channel, Status)."""

from __future__ import annotations

import mlx.core as mx
import psutil


def stats() -> dict[str, int]:
    return {
        "active_memory": int(mx.get_active_memory()),
        "peak_memory": int(mx.get_peak_memory()),
        "rss": int(psutil.Process().memory_info().rss),
        "free_memory": int(psutil.virtual_memory().available),
    }
