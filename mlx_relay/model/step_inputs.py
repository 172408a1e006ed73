"""A forward step's inputs besides the hidden state, as a stage's layers take them.

Some families' layers need more than the hidden state, and what they need can only be
computed on rank 0: Qwen2-VL's multimodal rope positions come from the image grid,
which only rank 0 sees. Rank 0 sends such arrays with the step (protocol/header.py:
side arrays, and one position delta per sequence in the header itself), and every rank
turns them into its layers' keyword arguments here, with the family's own code, so a
stage computes exactly what the whole model computes. A family not in `LAYER_INPUTS`
gets none and pays nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_relay.protocol import header as hdr


@dataclass
class PromptInputs:
    """What rank 0 feeds a prompt's prefill besides token ids (an image request): the
    merged input embeddings (1, tokens, hidden), for a multimodal-rope model the
    positions (3, 1, tokens) and the delta its decode positions keep (offset + delta)."""

    embeddings: mx.array
    positions: mx.array | None = None
    delta: int = 0

    def chunk(self, start: int, n: int) -> PromptInputs:
        """Prompt positions [start, start + n): one prefill chunk's share."""
        positions = None if self.positions is None else self.positions[..., start : start + n]
        return PromptInputs(self.embeddings[:, start : start + n], positions, self.delta)


@dataclass
class LayerInputs:
    """What the rows of one stage call need besides h: each row's first position and
    position delta (from the header), and the side arrays rank 0 sent, if any."""

    offsets: list[int]
    deltas: list[int]
    positions: mx.array | None = None  # (3, rows, tokens): explicit multimodal positions

    @classmethod
    def of_step(
        cls, header: hdr.StepHeader, sides: dict[int, mx.array], rows: slice, length: int
    ) -> LayerInputs:
        """The inputs of the step's rows `rows`, their first `length` tokens."""
        positions = sides.get(hdr.SIDE_POSITIONS)
        return cls(
            offsets=header.offsets[rows],
            deltas=(header.deltas or [0] * header.n_seqs)[rows],
            positions=None if positions is None else positions[:, rows, :length],
        )

    def row(self, i: int) -> LayerInputs:
        """Row `i` alone (a decode group run row by row)."""
        positions = None if self.positions is None else self.positions[:, i : i + 1]
        return dataclasses.replace(
            self,
            offsets=self.offsets[i : i + 1],
            deltas=self.deltas[i : i + 1],
            positions=positions,
        )


def _mrope(layers: list[Any], h: mx.array, inputs: LayerInputs) -> dict[str, Any]:
    """Qwen2-VL / Qwen2.5-VL (mlx-vlm): each layer takes the position ids and the rope's
    cos/sin, computed once per forward from them, as its LanguageModel and Qwen2Model do.
    Rank 0 sends a prompt's 3-D positions (temporal, height, width); without them a row's
    token j sits at offset + delta + j on all three axes, which mlx-vlm writes as 2-D
    position ids (text, and every decode step: offset + rope_delta)."""
    positions = inputs.positions
    if positions is None:
        rows, length = h.shape[:2]
        start = mx.array([o + d for o, d in zip(inputs.offsets, inputs.deltas, strict=True)])
        positions = mx.arange(length)[None, :] + start[:, None]
    rotary = layers[0].self_attn.rotary_emb
    embeddings = None if rotary.fused_apply else rotary(h, positions)
    return {"position_ids": positions, "position_embeddings": embeddings}


# family -> (this rank's layers, h entering them, the step's inputs) -> each layer's
# keyword arguments for this call
LAYER_INPUTS: dict[str, Callable[[list[Any], mx.array, LayerInputs], dict[str, Any]]] = {
    "qwen2_vl": _mrope,
    "qwen2_5_vl": _mrope,
}
