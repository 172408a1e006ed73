"""A forward step's inputs besides the hidden state, as a stage's layers take them.

Some families' layers need more than the hidden state, and what they need can only be
computed on rank 0: Qwen2-VL's multimodal rope positions come from the image grid,
which only rank 0 sees; gemma4's per-layer inputs come from the token ids through a
per-layer embedding table as large as most of the model, which only rank 0 holds. Rank
0 sends such arrays with the step (protocol/header.py: side arrays after the hidden
state, and one position delta per sequence in the header itself), and every rank turns
them into its layers' keyword arguments here, with the family's own code, so a stage
computes exactly what the whole model computes. A family whose adapter names none of
these (families/: `layer_inputs`) gets none and pays nothing.

Positions are forwarded unchanged (every rank needs them all); per-layer inputs hold
one slice per layer, and each rank keeps its own layers' slices and forwards the rest
(`pass_on`), so a hop carries only what the ranks after it still need.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_relay.protocol import header as hdr


@dataclass
class PromptInputs:
    """What rank 0 feeds a prompt's prefill besides token ids (an image request): the
    merged input embeddings (1, tokens, hidden), for a multimodal-rope model the
    positions (3, 1, tokens) and the delta its decode positions keep (offset + delta);
    for gemma4 the per-layer inputs its model takes from the ids (1, tokens, layers,
    dim; not yet projected) and the token types (1, tokens) that its image mask reads."""

    embeddings: mx.array
    positions: mx.array | None = None
    delta: int = 0
    per_layer: mx.array | None = None
    token_types: mx.array | None = None

    def chunk(self, start: int, n: int) -> PromptInputs:
        """Prompt positions [start, start + n): one prefill chunk's share."""

        def part(a: mx.array | None) -> mx.array | None:
            return None if a is None else a[:, start : start + n]

        positions = None if self.positions is None else self.positions[..., start : start + n]
        return PromptInputs(
            part(self.embeddings),
            positions,
            self.delta,
            part(self.per_layer),
            part(self.token_types),
        )


@dataclass
class LayerInputs:
    """What the rows of one stage call need besides h: each row's first position and
    position delta (from the header), and the side arrays rank 0 sent, if any."""

    offsets: list[int]
    deltas: list[int]
    positions: mx.array | None = None  # (3, rows, tokens): explicit multimodal positions
    per_layer: mx.array | None = None  # (rows, tokens, layers from this rank's first, dim)
    token_types: mx.array | None = None  # (rows, tokens): gemma4's image prompt

    @classmethod
    def of_step(
        cls, header: hdr.StepHeader, sides: dict[int, mx.array], rows: slice, length: int
    ) -> LayerInputs:
        """The inputs of the step's rows `rows`, their first `length` tokens."""
        positions = sides.get(hdr.SIDE_POSITIONS)
        per_layer = sides.get(hdr.SIDE_PER_LAYER)
        types = sides.get(hdr.SIDE_TOKEN_TYPES)
        return cls(
            offsets=header.offsets[rows],
            deltas=(header.deltas or [0] * header.n_seqs)[rows],
            positions=None if positions is None else positions[:, rows, :length],
            per_layer=None if per_layer is None else per_layer[rows, :length],
            token_types=None if types is None else types[rows, :length],
        )

    def row(self, i: int) -> LayerInputs:
        """Row `i` alone (a decode group run row by row)."""
        return dataclasses.replace(
            self,
            offsets=self.offsets[i : i + 1],
            deltas=self.deltas[i : i + 1],
            positions=None if self.positions is None else self.positions[:, i : i + 1],
            per_layer=None if self.per_layer is None else self.per_layer[i : i + 1],
            token_types=None if self.token_types is None else self.token_types[i : i + 1],
        )


def pass_on(header: hdr.StepHeader, sides: list[mx.array], local_layers: int) -> list[mx.array]:
    """The side arrays a rank holding `local_layers` layers sends on, `header` rewritten
    to list them: per-layer inputs less this rank's layers' slices, the rest unchanged.
    (Whatever the rank computed or failed to, the header and the arrays agree.)"""
    out = []
    for i, (side, array) in enumerate(zip(header.sides, sides, strict=True)):
        if side.kind == hdr.SIDE_PER_LAYER:
            array = array[:, :, local_layers:]
            header.sides[i] = dataclasses.replace(side, shape=tuple(array.shape))
        out.append(array)
    return out


def mrope(layers: list[Any], h: mx.array, inputs: LayerInputs) -> list[dict[str, Any]]:
    """Qwen2-VL / Qwen2.5-VL (mlx-vlm): each layer takes the position ids and the rope's
    cos/sin, computed once per forward from them, as its LanguageModel and Qwen2Model do.
    Rank 0 sends a prompt's 3-D positions (temporal, height, width); without them a row's
    token j sits at offset + delta + j on all three axes, which mlx-vlm writes as 2-D
    position ids (text, and every decode step: offset + rope_delta)."""
    positions = inputs.positions
    if positions is None:
        length = h.shape[1]
        start = mx.array([o + d for o, d in zip(inputs.offsets, inputs.deltas, strict=True)])
        positions = mx.arange(length)[None, :] + start[:, None]
    rotary = layers[0].self_attn.rotary_emb
    embeddings = None if rotary.fused_apply else rotary(h, positions)
    return [{"position_ids": positions, "position_embeddings": embeddings}] * len(layers)


def per_layer(layers: list[Any], h: mx.array, inputs: LayerInputs) -> list[dict[str, Any]]:
    """gemma4 (2B/4B layouts), gemma3n: layer i takes its slice of the per-layer inputs."""
    per_layer = inputs.per_layer
    if per_layer is None:  # (a probe run; a gemma4 VLM without them: token types only)
        return [{"per_layer_input": None}] * len(layers)
    return [{"per_layer_input": per_layer[:, :, i, :]} for i in range(len(layers))]


def step_offset(layers: list[Any], h: mx.array, inputs: LayerInputs) -> list[dict[str, Any]]:
    """bailing_moe_linear, bailing_hybrid: every layer takes the step's first position,
    which their forward reads from an attention layer's cache (a rank may hold none):
    here from the header, one per row where a group has several."""
    offsets = inputs.offsets
    offset: int | mx.array = offsets[0] if len(offsets) == 1 else mx.array(offsets)
    return [{"offset": offset}] * len(layers)
