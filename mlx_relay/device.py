"""Which device this process computes on, as the layers that differ by backend ask it."""

from __future__ import annotations

import mlx.core as mx


def on_gpu() -> bool:
    """Whether MLX computes on a GPU here (Metal or CUDA), not the CPU."""
    return mx.default_device() == mx.gpu


def on_cuda() -> bool:
    """Whether MLX computes on a CUDA GPU here (collective hops, settled receives, the
    verify steps' attention differ there)."""
    cuda = getattr(mx, "cuda", None)  # (MLX builds without the module: not CUDA)
    return on_gpu() and cuda is not None and cuda.is_available()


def compute_dtype() -> mx.Dtype:
    """The dtype this device's models compute in, for the probes timed at load: a probe
    (a rank's weight-reading speed, a layer's decode step, an all-sum of a token's
    hidden state) is only worth its figure if it moves the bytes a real step moves:
    bfloat16 on a GPU, where models run in half precision, float32 on a CPU, where MLX
    computes the random-weight and default models' activations in float32."""
    return mx.bfloat16 if on_gpu() else mx.float32
