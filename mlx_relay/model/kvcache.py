"""KV caches per sequence slot, and per decode group as one batch: the same on every rank.

A sequence is prefilled alone in its own cache (exactly as single-process mlx-lm would),
then joins a decode group, whose caches are mlx-lm batch caches. Rank 0 and every
worker apply the same rule when a group's slot list changes (drop the slots that left,
append the ones that joined), so all ranks hold identical batches without exchanging
anything beyond the step header.

Caches are of whatever kinds the model makes per layer (KVCache, RotatingKVCache for
sliding windows, ArraysCache for conv/SSM state, a CacheList of several): each kind
merges into its own batch form, filters, extends and extracts. Positions are kept here
on the host, not read from the caches: an SSM state has no offset, and reading a device
offset would wait. With --kv-bits, plain KV caches are quantized as mlx-lm does, and a
decode group runs row by row on them (sharding.Rows): they have no batch form.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from mlx_relay.model import sharding
from mlx_relay.model.prefix_store import BLOCK_TOKENS, BlockStore, StoreError


class CacheError(ValueError):
    """A step that does not fit the caches this rank holds: the ranks disagree."""


@dataclass
class _Group:
    slots: list[int]
    caches: list[Any]
    # Each row's position, kept on the host: the caches' own offsets live on the
    # device, and reading them would wait for the step before.
    positions: list[int]


class SlotCaches:
    def __init__(self, shard: sharding.Shard) -> None:
        self.shard = shard
        self.single: dict[int, list[Any]] = {}
        self.at: dict[int, int] = {}  # each single sequence's position
        self.groups: dict[int, _Group] = {}
        # each sequence's ids so far, where rank 0's embedding reads them (embeds_ids)
        self.ids: dict[int, mx.array] = {}

    def ids_before(self, slot: int, offset: int, source: int | None = None) -> mx.array:
        """The ids (1, offset) of the sequence before a step from `offset`: the slot's
        own, or those of the parked `source` it starts from (as for_sequence's caches)."""
        if offset == 0:
            return mx.zeros((1, 0), mx.int32)
        held = self.ids.get(slot if source is None else source)
        if held is None or held.shape[1] < offset:
            raise CacheError(f"slot {slot} holds no ids up to position {offset}")
        return held[:, :offset]

    def record_ids(self, slot: int, before: mx.array, new: mx.array) -> None:
        """The slot's ids after a step: those before it, then its own (1, length)."""
        self.ids[slot] = mx.concatenate([before, new.astype(before.dtype)], axis=1)

    def for_sequence(
        self,
        slot: int,
        offset: int,
        source: int | None = None,
        length: int = 1,
        *,
        again: bool = False,
    ) -> list[Any]:
        """The caches of one sequence outside any group, for a step of `length` tokens
        from `offset` (offset 0 starts afresh).

        With a `source` slot, a parked cache shares the first `offset` positions with the
        new sequence: the slot's own is cut back to them; another slot's is copied up to
        them and stays parked. The engine asks only for what `shard.usable_prefix`
        allows: a cache that cannot be cut back is reused whole or not at all.
        """
        if again:  # (the second lap of a step whose first lap moved the caches on)
            return self._again(slot, offset + length)
        if offset == 0:
            self._drop([slot])
            self.single[slot] = sharding.new_caches(self.shard)
            self.at[slot] = 0
        elif source is not None and source != slot:
            parked = self.single.get(source)
            if parked is None or self.at.get(source, 0) < offset:
                raise CacheError(f"slot {source} holds no cache of {offset} positions to copy")
            self._drop([slot])
            held = self.at[source]
            self.single[slot] = [_copy_prefix(c, offset, held) for c in parked]
            self.at[slot] = offset
        caches = self.single.get(slot)
        if caches is None:
            raise CacheError(f"slot {slot} has no cache at position {offset}")
        if source == slot and self.at[slot] > offset:
            for c in caches:
                if not c.is_trimmable():
                    raise CacheError(f"slot {slot}: a {type(c).__name__} cannot be cut back")
                c.trim(self.at[slot] - offset)
            self.at[slot] = offset
        if self.at[slot] != offset:
            raise CacheError(f"slot {slot} is at position {self.at[slot]}, step says {offset}")
        self.at[slot] = offset + length
        self._quantize(caches)
        return caches

    def for_group(
        self, group: int, slots: list[int], offsets: list[int], *, again: bool = False
    ) -> list[Any]:
        """The batch caches of a decode group holding exactly `slots`, in that order,
        for a step of one token per row (they move on by one position). `again`: a
        second lap of the step (Shard.passes), on caches its first lap moved on."""
        if again:
            if not self.shard.row_by_row:
                raise CacheError("a second lap needs each row's own caches (row by row)")
            return sharding.Rows(self._again(s, o + 1) for s, o in zip(slots, offsets, strict=True))
        if self.shard.row_by_row:  # quantized caches have no batch form, phi3small's
            return sharding.Rows(self._own(s, o) for s, o in zip(slots, offsets, strict=True))
        current = self.groups.get(group)
        if current is None and len(slots) == 1:
            # A group of one decodes on the sequence's own cache, as single-process
            # mlx-lm does: no batch padding, masks or offset arrays to compute per step.
            return self._own(slots[0], offsets[0])
        if current is None or current.slots != slots:
            current = self._rebuild(group, current, slots)
        if current.positions != offsets:
            raise CacheError(
                f"group {group} is at positions {current.positions}, step says {offsets}"
            )
        current.positions = [p + 1 for p in offsets]
        return current.caches

    def _again(self, slot: int, at: int) -> list[Any]:
        """A sequence's own caches as the first lap of a step left them, at `at`."""
        caches = self.single.get(slot)
        if caches is None or self.at.get(slot) != at:
            raise CacheError(f"slot {slot} is not where a step's first lap left it ({at})")
        return caches

    def _own(self, slot: int, offset: int) -> list[Any]:
        caches = self.single.get(slot)
        if caches is None:
            raise CacheError(f"slot {slot} decodes but was never prefilled")
        if self.at[slot] != offset:
            raise CacheError(f"slot {slot} is at position {self.at[slot]}, step says {offset}")
        self.at[slot] = offset + 1
        self._quantize(caches)
        return caches

    def _quantize(self, caches: list[Any]) -> None:
        """With --kv-bits: quantize before the step what mlx-lm quantizes after the one
        before (sharding.quantize_caches), which is the same state."""
        if self.shard.kv is not None:
            sharding.quantize_caches(caches, self.shard.kv)

    def _rebuild(self, group: int, current: _Group | None, slots: list[int]) -> _Group:
        kept_slots, caches, positions = (
            ([], None, [])
            if current is None
            else (current.slots, current.caches, current.positions)
        )
        keep = [i for i, s in enumerate(kept_slots) if s in slots]
        if caches is not None and len(keep) < len(kept_slots):
            if keep:
                for c in caches:
                    c.filter(mx.array(keep))
            else:
                caches = None
            kept_slots = [kept_slots[i] for i in keep]
            positions = [positions[i] for i in keep]
        joining = [s for s in slots if s not in kept_slots]
        for s in joining:
            if s not in self.single:
                raise CacheError(f"slot {s} joins group {group} but was never prefilled")
        if joining:
            per_sequence = [self.single.pop(s) for s in joining]
            positions = positions + [self.at.pop(s) for s in joining]
            merged = [
                type(layer[0]).merge(list(layer)) for layer in zip(*per_sequence, strict=True)
            ]
            if caches is None:
                caches = merged
            else:
                for c, m in zip(caches, merged, strict=True):
                    c.extend(m)
            kept_slots = kept_slots + joining
        if kept_slots != slots:
            raise CacheError(f"group {group} holds slots {kept_slots}, step lists {slots}")
        rebuilt = _Group(kept_slots, caches or [], positions)
        self.groups[group] = rebuilt
        return rebuilt

    def park(self, slots: list[int]) -> None:
        """Keep finished sequences' caches for reuse: a slot in a decode group leaves
        it with its own rows (left padding dropped) as a single sequence's cache."""
        for slot in slots:
            for g in self.groups.values():
                if slot in g.slots:
                    i = g.slots.index(slot)
                    own = [c.extract(i) for c in g.caches]
                    # Computed in the background; then the batch arrays can go.
                    mx.async_eval(_arrays(own))
                    self.single[slot] = own
                    self.at[slot] = g.positions[i]
        self.free_groups(slots)

    def blocks(self, restore: bool, slot: int, store: BlockStore | None, document: dict) -> None:
        """One rank's part of CMD_STORE / CMD_RESTORE (`restore`) of `slot`, from rank 0's
        document ({"blocks": [[index, key], ...]} / {"keys": [...]}): a store never fails
        (a rank with no store keeps nothing); StoreError or CacheError where a restore
        cannot."""
        if restore:
            if store is None:
                raise StoreError("this rank keeps no prompt store")
            self.restore(slot, store, list(document["keys"]))
        elif store is not None:
            self.store(slot, store, [tuple(b) for b in document["blocks"]])

    def store(self, slot: int, store: BlockStore, blocks: list[tuple[int, str]]) -> int:
        """Write blocks (index, key) of a parked slot's caches to this rank's store;
        the bytes written (0 where it holds none: nothing to keep, no failure)."""
        caches = self.single.get(slot)
        return store.save(caches, blocks) if caches is not None else 0

    def restore(self, slot: int, store: BlockStore, keys: list[str]) -> None:
        """The slot's caches become the blocks `keys` from this rank's store, as one
        sequence's at position len(keys) * BLOCK_TOKENS; StoreError where they cannot."""
        caches = store.load(keys)
        if len(caches) != len(self.shard.layers):
            raise CacheError(
                f"the store holds {len(caches)} layers, this rank has {len(self.shard.layers)}"
            )
        self.free([slot])
        self.single[slot] = caches
        self.at[slot] = len(keys) * BLOCK_TOKENS

    def free(self, slots: list[int]) -> None:
        self._drop(slots)
        for slot in slots:
            self.ids.pop(slot, None)

    def _drop(self, slots: list[int]) -> None:
        """The slots' caches gone (their ids stay: a step starting afresh has recorded
        its own already)."""
        for slot in slots:
            self.single.pop(slot, None)
            self.at.pop(slot, None)
        self.free_groups(slots)

    def free_groups(self, slots: list[int]) -> None:
        """Drop the slots' rows from their decode groups."""
        for gid, g in list(self.groups.items()):
            if any(s in g.slots for s in slots):
                keep = [i for i, s in enumerate(g.slots) if s not in slots]
                if not keep:
                    del self.groups[gid]
                    continue
                for c in g.caches:
                    c.filter(mx.array(keep))
                g.slots = [g.slots[i] for i in keep]
                g.positions = [g.positions[i] for i in keep]

    def clear(self) -> None:
        self.ids.clear()
        self.single.clear()
        self.at.clear()
        self.groups.clear()


def _arrays(caches: list[Any]) -> list[mx.array]:
    """Every array the caches hold, whatever their kinds (an SSM state may hold None)."""
    return [a for _, a in tree_flatten([c.state for c in caches]) if isinstance(a, mx.array)]


def _copy_prefix(cache: Any, n: int, held: int) -> Any:
    """A new cache of the same kind holding the first `n` of the `held` positions of
    `cache`, in its own arrays (caches update their arrays in place). A sliding window
    is cut only before anything left it (its buffer is then in order); a state is only
    copied whole."""
    if isinstance(cache, CacheList):
        return CacheList(*(_copy_prefix(c, n, held) for c in cache.caches))
    if isinstance(cache, sharding.STATE_CACHES) and n != held:
        raise CacheError(f"a {type(cache).__name__} of {held} positions cannot be cut back")
    if isinstance(cache, ArraysCache):
        out = ArraysCache(len(cache.cache))
        out.cache = [None if a is None else mx.contiguous(a) for a in cache.cache]
    elif isinstance(cache, sharding.DeepSeekLayerCache):
        out = copy.copy(cache)  # (its updates make new arrays: sharing them is safe)
    elif isinstance(cache, RotatingKVCache):
        out = RotatingKVCache(cache.max_size, cache.keep)
        if n == cache.offset:
            out.keys, out.values = mx.contiguous(cache.keys), mx.contiguous(cache.values)
            out.offset, out._idx = cache.offset, cache._idx
        elif cache.offset < cache.max_size:
            out.keys = mx.contiguous(cache.keys[..., :n, :])
            out.values = mx.contiguous(cache.values[..., :n, :])
            out.offset = out._idx = n
        else:
            raise CacheError(f"a sliding window past {cache.max_size} cannot be cut back")
    elif type(cache) is KVCache:
        out = KVCache()
        out.keys = mx.contiguous(cache.keys[..., :n, :])
        out.values = mx.contiguous(cache.values[..., :n, :])
        out.offset = n
    else:
        raise CacheError(f"a {type(cache).__name__} cannot be copied")
    mx.eval(_arrays([out]))
    return out
