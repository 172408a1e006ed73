"""Which slot a new sequence takes, and whose finished caches stay for a later prompt.

Rank 0's bookkeeping only: a slot names a KV cache on every rank, and the engine turns
these decisions into step headers (FLAG_PARK, FLAG_REUSE with a source slot) that every
rank applies in the same order. A parked slot's token list is exactly what its caches
hold on every rank.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

# Shorter shared prefixes (a BOS token, the first words of a chat template) are not worth
# a parked cache: a new prompt then starts afresh instead of displacing one.
MIN_SHARED = 16


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class Taken:
    slot: int
    cached: int = 0  # prompt tokens already in parked caches
    source: int | None = None  # the parked slot holding them (== slot: taken over)
    held: list[int] | None = None  # a taken-over slot's tokens, to park it again unused
    restore: tuple[str, ...] = ()  # stored blocks loaded into the slot first (prefix_index)
    salt: str = ""  # the request's cache salt: a taken-over slot is parked again under it


class SlotTable:
    def __init__(self, n: int) -> None:
        self.free: list[int] = list(range(n))  # no caches worth keeping
        self.parked: OrderedDict[int, list[int]] = OrderedDict()  # least recent first
        self.pinned: Counter[int] = Counter()  # parked slots a pending copy will read
        # Each parked slot's cache salt: a prompt is served only from parked caches of
        # its own salt (tenants that must not share prefixes give different ones).
        self.salts: dict[int, str] = {}
        # (held, shared) -> whether a parked cache of `held` tokens serves its first
        # `shared` exactly (Shard.usable_prefix: an SSM state only whole, say).
        self.usable: Callable[[int, int], bool] = lambda held, shared: True

    def open(self) -> int:
        """Slots a new sequence can take now: empty ones and unpinned parked ones."""
        return len(self.free) + sum(1 for s in self.parked if not self.pinned[s])

    def take(self, prompt: list[int], salt: str = "") -> Taken:
        """A slot for a new sequence, and what of its prompt parked caches of the same
        `salt` already hold.

        The parked slot sharing the longest prefix serves: taken over when the new
        sequence keeps all it holds (the next turn of a chat), else copied into an empty
        slot, so that it stays for its own conversation (one system prompt, many
        conversations); a copy source is pinned until `unpin`. Otherwise: an empty slot,
        else the least recently parked unpinned one, whose caches start afresh. Call
        only when `open()` is not 0.
        """
        best, shared = None, 0
        for slot, tokens in self.parked.items():
            if self.salts.get(slot, "") != salt:
                continue
            n = common_prefix_len(tokens, prompt)
            if n > shared and self.usable(len(tokens), min(n, len(prompt) - 1)):
                best, shared = slot, n
        cached = min(shared, len(prompt) - 1)  # the last prompt token must run for logits
        if best is not None and (cached >= MIN_SHARED or cached == len(prompt) - 1 > 0):
            if self.free and (cached < len(self.parked[best]) or self.pinned[best]):
                self.parked.move_to_end(best)
                self.pinned[best] += 1
                return Taken(self.free.pop(0), cached, best, salt=salt)
            if not self.pinned[best]:
                return Taken(best, cached, best, self.parked.pop(best), salt=salt)
        if self.free:
            return Taken(self.free.pop(0), salt=salt)
        slot = next(s for s in self.parked if not self.pinned[s])
        del self.parked[slot]
        return Taken(slot, salt=salt)

    def unpin(self, slot: int) -> None:
        self.pinned[slot] -= 1
        if self.pinned[slot] <= 0:
            del self.pinned[slot]

    def park(self, slot: int, tokens: list[int], salt: str = "") -> None:
        self.parked[slot] = tokens
        self.salts[slot] = salt

    def release(self, slot: int) -> None:
        """The slot's caches are gone (or never were) on every rank."""
        self.free.append(slot)

    def over_budget(self, max_tokens: int) -> list[int]:
        """Unpark the oldest unpinned slots while all hold more than `max_tokens` tokens
        (the newest stays); the caller frees them on every rank, then releases them."""
        out = []
        held = sum(len(t) for t in self.parked.values())
        for slot in list(self.parked)[:-1]:
            if held <= max_tokens:
                break
            if self.pinned[slot]:
                continue
            held -= len(self.parked.pop(slot))
            out.append(slot)
        return out

    def forget(self, slots: list[int]) -> list[int]:
        """Unpark these slots (their park failed on some rank); returns those that were."""
        out = [s for s in slots if s in self.parked]
        for s in out:
            del self.parked[s]
            self.pinned.pop(s, None)
        return out

    def reset(self) -> None:
        """Every rank's caches were replaced or dropped."""
        self.free = sorted(self.free + list(self.parked))
        self.parked.clear()
        self.pinned.clear()

    def stats(self) -> tuple[int, int]:
        return len(self.parked), sum(len(t) for t in self.parked.values())
