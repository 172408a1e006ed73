"""Rank 0's index of the prompt-cache blocks every rank keeps on disk (`--prompt-cache-dir`).

A prompt's blocks of BLOCK_TOKENS tokens are named by a chain of hashes: a block's key
is the SHA-256 of the key before it and its own tokens, the first seeded by the model
and split's identity and the request's cache salt. So a key names the whole prefix up
to its block's end (equal keys, equal prefixes), two prompts sharing a system prompt
share its blocks' keys, and tenants with different salts (`cache_salt`) share none.

The index is the set of keys in rank 0's own store (model/prefix_store.py), read at load:
a cluster started again with the same model, split and settings finds its blocks. A
worker that lost one of them (its disk budget, a damaged file) fails the restore, and
rank 0 forgets the keys it asked for (`forget`); they are written again on the next park.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

from mlx_relay.model.prefix_store import BLOCK_TOKENS


@dataclass
class PrefixIndex:
    seed: str  # the model and split's identity (prefix_store.identity of rank 0)
    known: set[str] = field(default_factory=set)
    # Counters for status and metrics.
    restored_tokens: int = 0
    restores: int = 0
    failed_restores: int = 0
    stored_blocks: int = 0

    def keys(self, tokens: list[int], salt: str = "") -> list[str]:
        """The keys of every whole block of `tokens`, in order."""
        out: list[str] = []
        last = hashlib.sha256(f"{self.seed}\0{salt}".encode()).hexdigest()
        for i in range(len(tokens) // BLOCK_TOKENS):
            block = tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]
            h = hashlib.sha256(last.encode())
            h.update(struct.pack(f"<{len(block)}i", *block))
            last = h.hexdigest()[:40]
            out.append(last)
        return out

    def longest(self, prompt: list[int], salt: str = "") -> list[str]:
        """The keys of the longest stored prefix of `prompt` that leaves its last token
        to run (a step must compute the logits of the last prompt token)."""
        keys = self.keys(prompt[: len(prompt) - 1], salt)
        n = 0
        while n < len(keys) and keys[n] in self.known:
            n += 1
        return keys[:n]

    def missing(self, tokens: list[int], salt: str = "") -> list[tuple[int, str]]:
        """The whole blocks of `tokens` not stored yet, as (index, key); counted as
        stored from now on (the store step that writes them is launched next)."""
        out = [(i, k) for i, k in enumerate(self.keys(tokens, salt)) if k not in self.known]
        self.known.update(k for _, k in out)
        self.stored_blocks += len(out)
        return out

    def forget(self, keys: list[str]) -> None:
        self.known.difference_update(keys)
