"""The slot steps a sequence's end or start leads to: the prompt-cache slot table
(slots.py) kept in step with the Free and Park steps every rank carries out.

The scheduler asks; each call appends the steps to launch, in order, to the `Outputs`
it is given. A step follows the steps in flight before it on every rank, so a slot is
free or parked here as soon as its step is asked for.
"""

from __future__ import annotations

from mlx_relay.coordinator.plan import Free, Outputs, Park, Restore, Store
from mlx_relay.coordinator.prefix_index import PrefixIndex
from mlx_relay.coordinator.sequence import Request, Sequence
from mlx_relay.coordinator.slots import SlotTable, Taken
from mlx_relay.model.prefix_store import BLOCK_TOKENS


class SlotSteps:
    def __init__(self, table: SlotTable, budget: int) -> None:
        self.table = table
        self.budget = budget  # --prompt-cache-tokens (0: as many as the slots hold)
        self.prefixes: PrefixIndex | None = None  # --prompt-cache-dir: the stored blocks
        # The loaded model prefills an image prompt only whole, from position 0
        # (vision.prefills_whole): an image request neither parks nor restores.
        self.whole_images = False

    def end(self, seq: Sequence, normally: bool, reuse: bool, out: Outputs) -> None:
        """`seq` ended (`normally`: with a chunk, not an error): its slot is given back,
        parked where `reuse` (the prompt cache is on and the model's caches can be cut
        back), or freed."""
        if seq.taken is not None and normally:  # ended before any step
            self.give_back(seq.taken, out)
            self.keep_to_budget(out)
        elif seq.taken is not None:  # its first step failed on rank 0: reset the slot
            self.first_step(seq, out)
            self.free(seq.slot, out)
        elif reuse and normally and seq.position and not (seq.has_images and self.whole_images):
            # (an image request's caches are parked under its image-keyed tokens, except
            # where an image prompt is only ever prefilled whole: nothing could reuse them)
            self.park(seq, out)
        else:
            self.free(seq.slot, out)

    def restart(self, seq: Sequence, out: Outputs) -> None:
        """Its parked source is gone before its first step: prefill the whole prompt."""
        self.first_step(seq, out)  # unpins
        prompt = seq.request.prompt_tokens
        seq.pending, seq.position, seq.context, seq.cached_tokens = list(prompt), 0, [], 0
        seq.restored = False

    def free(self, slot: int, out: Outputs) -> None:
        """The slot's caches go on every rank; it is empty from now on."""
        out.slots.append(Free(slot))
        self.table.release(slot)

    def park(self, seq: Sequence, out: Outputs) -> None:
        """It ended normally: its caches stay for a later prompt sharing a prefix (after
        its steps still in flight: the park step follows them everywhere)."""
        out.slots.append(Park(seq.slot))
        held = seq.cache_context()
        self.table.park(seq.slot, held, seq.request.cache_salt)
        if self.prefixes is not None:  # (its whole blocks to disk too, those not there)
            blocks = self.prefixes.missing(held, seq.request.cache_salt)
            if blocks:
                out.slots.append(Store(seq.slot, tuple(blocks)))
        self.keep_to_budget(out)

    def restorable(self, request: Request, taken: Taken, out: Outputs) -> Taken:
        """`taken`, or, where the prompt store holds a longer prefix of the prompt than
        the parked caches give, the same slot filled with those blocks first (a Restore
        step; the sequence waits for it). A taken-over parked cache is given up for it,
        a copy source unpinned."""
        if self.prefixes is None or (request.pixel_values is not None and self.whole_images):
            return taken
        keys = self.prefixes.longest(request.cache_tokens(), request.cache_salt)
        if len(keys) * BLOCK_TOKENS <= taken.cached:
            return taken
        if taken.source is not None and taken.source != taken.slot:
            self.table.unpin(taken.source)
        wanted = tuple(keys)  # (the one tuple: its Restore's return is matched by it)
        out.slots.append(Restore(taken.slot, wanted))
        cached = len(keys) * BLOCK_TOKENS
        return Taken(taken.slot, cached, taken.slot, restore=wanted, salt=taken.salt)

    def restored(self, seq: Sequence) -> None:
        """Its Restore came back from every rank: its first step may go."""
        seq.restoring, seq.restored = False, True
        if self.prefixes is not None:
            self.prefixes.restores += 1
            self.prefixes.restored_tokens += seq.cached_tokens

    def restore_failed(self, seq: Sequence, out: Outputs) -> None:
        """Some rank could not load the blocks: the whole prompt is prefilled, and the
        keys asked for are forgotten (the next park writes them again)."""
        keys = seq.taken.restore if seq.taken is not None else ()
        if self.prefixes is not None:
            self.prefixes.forget(list(keys))
            self.prefixes.failed_restores += 1
        seq.restoring = False
        self.restart(seq, out)

    def give_back(self, taken: Taken, out: Outputs) -> None:
        """A slot taken for a sequence that never ran a step: no rank touched its caches."""
        if taken.held is not None:
            self.table.park(taken.slot, taken.held, taken.salt)
            return
        if taken.source is not None:  # a copy source, pinned for this sequence
            self.table.unpin(taken.source)
        self.free(taken.slot, out)  # it may hold an evicted cache on every rank

    def first_step(self, seq: Sequence, out: Outputs) -> None:
        """Rank 0 copied or cut back at launch, and every worker does so before any later
        step: a copy source may be taken or evicted again."""
        taken, seq.taken = seq.taken, None
        if taken is not None and taken.source not in (None, taken.slot):
            self.table.unpin(taken.source)
            self.keep_to_budget(out)

    def keep_to_budget(self, out: Outputs) -> None:
        """Free the oldest parked caches beyond --prompt-cache-tokens on every rank."""
        if self.budget <= 0:
            return
        for slot in self.table.over_budget(self.budget):
            self.free(slot, out)

    def forget(self, slots: list[int], out: Outputs) -> None:
        """Parked caches on `slots` may not hold what the other ranks' copies hold (a
        rank failed a step on them): nobody may reuse them."""
        for slot in self.table.forget(slots):
            self.free(slot, out)
