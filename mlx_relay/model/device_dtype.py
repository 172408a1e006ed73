"""The dtype this device's models compute in, for the probes timed at load.

A probe (a rank's weight-reading speed, a layer's decode step, an all-sum of a token's
hidden state) is only worth its figure if it moves the bytes a real step moves: bfloat16
on a GPU, where models run in half precision, float32 on a CPU, where MLX computes the
random-weight and default models' activations in float32.
"""

from __future__ import annotations

import mlx.core as mx


def device_dtype() -> mx.Dtype:
    """bfloat16 on a GPU, float32 on a CPU."""
    return mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
