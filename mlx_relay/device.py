"""Which device this process computes on, as the layers that differ by backend ask it."""

from __future__ import annotations

import mlx.core as mx


def on_cuda() -> bool:
    """Whether MLX computes on a CUDA GPU here (collective hops, settled receives, the
    verify steps' attention differ there)."""
    cuda = getattr(mx, "cuda", None)  # (MLX builds without the module: not CUDA)
    return mx.default_device() == mx.gpu and cuda is not None and cuda.is_available()
