"""One rank's share of one step: the same function on rank 0 and on every worker."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from mlx_relay.model import attention, sharding
from mlx_relay.model.kvcache import SlotCaches
from mlx_relay.model.step_inputs import LayerInputs
from mlx_relay.protocol import header as hdr


def forward_stage(
    shard: sharding.Shard,
    caches: SlotCaches,
    header: hdr.StepHeader,
    h: mx.array,
    sides: Sequence[mx.array] = (),
) -> mx.array:
    """This rank's layers for one step: a decode group as one batch, else each sequence alone.

    Rank 0 runs the very same function on its embeddings, so every rank treats a step
    identically. `sides`: the side arrays the header lists (what the layers of a family
    with an adapter's `layer_inputs` take besides h: multimodal rope positions, per-layer
    inputs from this rank's first layer on).
    """
    # (a verify step's few positions: on CUDA without a cuDNN graph per key length)
    with attention.unfused(bool(header.flags & hdr.FLAG_ALL_POSITIONS) and attention.wanted()):
        return _forward(shard, caches, header, h, sides)


def _forward(
    shard: sharding.Shard,
    caches: SlotCaches,
    header: hdr.StepHeader,
    h: mx.array,
    sides: Sequence[mx.array],
) -> mx.array:
    takes_inputs = shard.takes_inputs
    arrays = {side.kind: a for side, a in zip(header.sides, sides, strict=True)} if sides else {}
    again = bool(header.flags & hdr.FLAG_SECOND_LAP)  # (the caches its first lap moved on)
    if header.group != hdr.NO_GROUP:
        batch = caches.for_group(header.group, header.slots, header.offsets, again=again)
        inputs = (
            LayerInputs.of_step(header, arrays, slice(None), h.shape[1]) if takes_inputs else None
        )
        return sharding.run_layers(shard, h, batch, inputs, second_pass=again)
    outputs = []
    source = header.source if header.flags & hdr.FLAG_REUSE else None
    for i, (slot, offset, length) in enumerate(
        zip(header.slots, header.offsets, header.lengths, strict=True)
    ):
        caches_i = caches.for_sequence(slot, offset, source, length, again=again)
        inputs = (
            LayerInputs.of_step(header, arrays, slice(i, i + 1), length) if takes_inputs else None
        )
        out = sharding.run_layers(shard, h[i : i + 1, :length], caches_i, inputs, second_pass=again)
        if length < h.shape[1]:
            pad = mx.zeros((1, h.shape[1] - length, out.shape[-1]), dtype=out.dtype)
            out = mx.concatenate([out, pad], axis=1)
        outputs.append(out)
    return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=0)
