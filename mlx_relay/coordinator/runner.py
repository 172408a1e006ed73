"""Rank 0's own stage: its shard and caches, a step's inputs, its layers, the LM head.

Rank 0 is a rank like the others (worker/loop.py): it runs `forward_stage` on its
layers for every step. What only rank 0 does is at the two ends: it turns token ids
(or an image prompt's merged embeddings, model/vision.py) into the hidden state, makes
the side arrays a family's layers take besides it (model/step_inputs.py: multimodal rope
positions, per-layer inputs), and runs the LM head on what comes back. Whatever a family
needs of rank 0 the runner asks its shard, that is the family's adapter (model/families,
model/sharding.py): whether it embeds each row's earlier ids too (LongCat Flash), takes
per-layer inputs (gemma4), goes round the ring twice a step (model/two_pass.py), and how
wide the state it returns is. The ring driver (ring_driver.py) moves steps; it never
names a family.

With a tensor group (transport/tensor.py; pipeline.py chooses it at load), every rank
of rank 0's stage holds a slice of each of its layers (model/tensor_split.py): the
runner gives its input to the group's broadcast before its layers, and the same
`forward_stage` runs here and on every peer; the runner's inputs and outputs stay the
whole hidden state.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_relay.coordinator.ring_watch import RankFailure
from mlx_relay.model import memory, prefix_store, sharding
from mlx_relay.model.cache_sizes import warm_logged as warm_cache_sizes
from mlx_relay.model.kvcache import CacheError, SlotCaches
from mlx_relay.model.stage import forward_stage
from mlx_relay.model.step_inputs import PromptInputs, pass_on
from mlx_relay.protocol import control
from mlx_relay.protocol import header as hdr
from mlx_relay.transport.ring import dtype_name
from mlx_relay.transport.tensor import TensorGroup


def second_lap_header(first: hdr.StepHeader) -> hdr.StepHeader:
    """The header of a step's second lap (its first: FLAG_FIRST_LAP): the same rows and
    positions, on the caches the first lap left (no reuse to start from again)."""
    flags = first.flags & ~(hdr.FLAG_FIRST_LAP | hdr.FLAG_REUSE) | hdr.FLAG_SECOND_LAP
    return dataclasses.replace(
        first,
        flags=flags,
        step_id=0,
        slots=list(first.slots),
        offsets=list(first.offsets),
        lengths=list(first.lengths),
        deltas=list(first.deltas),
        sides=[],
    )


class StageRunner:
    """Rank 0's shard, its slot caches, and what its sequences carry from step to step.

    `on_ring`: other ranks hold the rest of the layers (else every lap runs here)."""

    def __init__(self, *, on_ring: bool) -> None:
        self.on_ring = on_ring
        self.shard: sharding.Shard | None = None
        self.caches: SlotCaches | None = None
        self.hidden_size = 0  # the loaded model's hidden size (what context costs)
        # slot -> its sequence's position delta (multimodal rope: set by its prompt's
        # positions, every later step's header carries it); empty for other models
        self._deltas: dict[int, int] = {}
        self._per_layer = False  # the model's layers take per-layer inputs (gemma4 2B/4B)
        self.tensor: TensorGroup | None = None  # the loaded model's layers split across it
        self.store: prefix_store.BlockStore | None = None  # --prompt-cache-dir: its blocks

    # --- the model -------------------------------------------------------------------
    def load(
        self, path: Path, start: int, end: int, kv: str | None, tensor: TensorGroup | None = None
    ) -> None:
        """Load layers [start, end) with the embedding and the LM head (with `tensor`,
        this rank's slice of each); RankFailure (rank 0's) where they turn out larger
        than its memory allows."""
        group = tensor.group if tensor is not None else None
        self.shard = sharding.load_shard(path, start, end, has_ends=True, kv=kv, tensor=group)
        self.tensor = tensor
        try:
            memory.check_measured(path, start, end, self.shard, ends=True)
        except memory.ShardTooBig as e:
            host = control.host_name()
            raise RankFailure(0, host, str(e), hdr.ERR_OUT_OF_MEMORY) from e
        self.caches = SlotCaches(self.shard)
        self._per_layer = sharding.computes_per_layer_inputs(self.shard)
        warm_cache_sizes(self.shard, path, tensor.size if tensor is not None else 1)

    def loaded(self) -> None:
        """The load held on every rank: the model is the one served."""
        assert self.shard is not None
        self.hidden_size = sharding.hidden_size(self.shard.config)

    def unload(self) -> None:
        self.store = None
        self.shard = None
        self.caches = None
        self.tensor = None
        self._deltas.clear()
        self._per_layer = False

    @property
    def laps(self) -> int:
        """How many times a step goes round the ring (two for a two-pass model)."""
        return self.shard.passes if self.shard is not None else 1

    # --- a step ------------------------------------------------------------------------
    def run(
        self,
        header: hdr.StepHeader,
        tokens: mx.array,
        *,
        reuse_from: int | None,
        prompt: PromptInputs | None,
    ) -> tuple[mx.array, list[mx.array]]:
        """Rank 0's part of a forward step: its input (embedded `tokens`, or a prompt's
        embeddings), the side arrays `header` is made to list, then its layers. Returns
        the hidden state to send on and the side arrays the next ranks need."""
        if self.shard is None or self.caches is None:
            raise RuntimeError("no model loaded")
        # (side inputs: only a multimodal-rope model's image prompts and later steps)
        sides = self._side_inputs(header, prompt) if prompt is not None or self._deltas else []
        if prompt is not None:
            h = prompt.embeddings
        elif sharding.embeds_ids(self.shard):  # (each row's earlier ids too)
            h = self._embed_with_ids(header, tokens, reuse_from)
        else:
            h = sharding.embed(self.shard, tokens, header.offsets)
        if self._per_layer:  # gemma4's per-layer inputs: every step, from the token ids
            ids_part = prompt.per_layer if prompt is not None else None  # (an image's)
            per_layer = sharding.per_layer_inputs(self.shard, tokens, h, ids_part)
            header.sides.append(
                hdr.SideArray(
                    hdr.SIDE_PER_LAYER, dtype_name(per_layer.dtype), tuple(per_layer.shape)
                )
            )
            sides.append(per_layer)
        two_laps = self.laps == 2
        if two_laps:  # (IQuest Loop Coder: the ring twice, see next_lap)
            header.flags |= hdr.FLAG_FIRST_LAP
        if self.tensor is not None:  # (every peer gets the very same input)
            header.flags |= hdr.FLAG_TENSOR
            if self.tensor.grid:  # (a hidden state hops on from each stage's last rank)
                header.payload_kind = hdr.PAYLOAD_HIDDEN
            header.payload_dtype = dtype_name(h.dtype)
            header.payload_shape = tuple(h.shape)
            h, sides = self.tensor.broadcast(h), self.tensor.send_all(sides)
        try:
            h = forward_stage(self.shard, self.caches, header, h, sides)
            if two_laps and not self.on_ring:  # (both passes here)
                h = forward_stage(self.shard, self.caches, second_lap_header(header), h)
        except CacheError as e:
            raise RuntimeError(f"rank 0: {e}") from e
        if sides:  # (what the next ranks need of them)
            sides = pass_on(header, sides, len(self.shard.layers))
        return h, sides

    def more_laps(self, header: hdr.StepHeader) -> bool:
        """Whether the step of `header`, come back, goes round again from here."""
        return bool(header.flags & hdr.FLAG_FIRST_LAP)

    def next_lap(self, header: hdr.StepHeader, h: mx.array) -> tuple[hdr.StepHeader, mx.array]:
        """A two-pass model's step after its first lap came back with every position
        (`h`): rank 0's layers' second pass on them, and the second lap's header."""
        assert self.shard is not None and self.caches is not None
        lap = second_lap_header(header)
        try:
            h = forward_stage(self.shard, self.caches, lap, h)
        except CacheError as e:
            raise RuntimeError(f"rank 0: {e}") from e
        lap.payload_shape = tuple(h.shape)
        return lap, h

    def logits(self, header: hdr.StepHeader, h: mx.array) -> mx.array:
        """The LM head on what came back: each row's last position (batch, vocab), or
        for a verify step (FLAG_ALL_POSITIONS) its one row's every position (tokens, vocab)."""
        if header.flags & hdr.FLAG_ALL_POSITIONS:
            return sharding.head(self.shard, h)[0]
        return sharding.head(self.shard, h)[:, -1, :]

    def returned_width(self, header: hdr.StepHeader) -> int | None:
        """The width of the state the last rank sends back for a forward step: what the
        model's last layer leaves (wider than what rank 0 sent where the layers widen
        it: Kimi K3's attention residuals); None for anything else."""
        if header.payload_kind != hdr.PAYLOAD_HIDDEN or self.shard is None:
            return None
        return sharding.output_width(self.shard, header.payload_shape[2], self.shard.num_layers)

    def free(self, slots: list[int], park: bool) -> None:
        """Drop the slots' caches here (or, with `park`, keep each for a prefix reuse)."""
        for slot in slots if self._deltas else ():
            self._deltas.pop(slot, None)
        if self.caches is not None:
            (self.caches.park if park else self.caches.free)(slots)

    def blocks(self, cmd: int, slot: int, document: dict[str, Any]) -> None:
        """Rank 0's part of CMD_STORE / CMD_RESTORE (SlotCaches.blocks, as each worker's
        stage does); StoreError or CacheError where a restore cannot."""
        restore = cmd == hdr.CMD_RESTORE
        if self.caches is None:
            if restore:
                raise prefix_store.StoreError("rank 0 holds no model")
            return
        if restore:
            self._deltas.pop(slot, None)
        self.caches.blocks(restore, slot, self.store, document)

    # --- a family's inputs -------------------------------------------------------------
    def _embed_with_ids(
        self, header: hdr.StepHeader, tokens: mx.array, reuse_from: int | None
    ) -> mx.array:
        """The embedding of a family that reads each sequence's earlier ids (LongCat
        Flash's n-gram embedding), which the slot caches keep from step to step."""
        assert self.caches is not None
        slots, offsets, lengths = header.slots, header.offsets, header.lengths
        before = [
            self.caches.ids_before(slot, offset, reuse_from)
            for slot, offset in zip(slots, offsets, strict=True)
        ]
        h = sharding.embed(self.shard, tokens, offsets, before)
        for i, (slot, length) in enumerate(zip(slots, lengths, strict=True)):
            self.caches.record_ids(slot, before[i], tokens[i : i + 1, :length])
        return h

    def _side_inputs(self, header: hdr.StepHeader, prompt: PromptInputs | None) -> list[mx.array]:
        """The step's side arrays, listed in `header`, and its sequences' deltas."""
        if prompt is not None and prompt.positions is not None:
            (slot,) = header.slots  # a prefill chunk: one sequence
            self._deltas[slot] = prompt.delta
            positions = prompt.positions.astype(mx.int32)
            header.sides = [hdr.SideArray(hdr.SIDE_POSITIONS, "int32", tuple(positions.shape))]
            header.deltas = [prompt.delta]
            return [positions]
        if prompt is not None and prompt.token_types is not None:  # gemma4's image mask
            types = prompt.token_types.astype(mx.int32)
            header.sides = [hdr.SideArray(hdr.SIDE_TOKEN_TYPES, "int32", tuple(types.shape))]
            return [types]
        if self._deltas:  # a multimodal-rope model with an image request running
            if header.group == hdr.NO_GROUP:  # a text prompt in the slot starts afresh
                for slot in header.slots:
                    self._deltas.pop(slot, None)
            deltas = [self._deltas.get(slot, 0) for slot in header.slots]
            header.deltas = deltas if any(deltas) else []
        return []
