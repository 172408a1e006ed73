"""Speculative decoding's rules: which models and requests speculate, and how many
proposals each round carries. Data in, data out (the drafts themselves: drafting.py).

A pipeline pays one trip through every rank per step. A *verify step* carries a
sequence's next input and k proposed tokens as one step of k+1 positions; rank 0
samples every position with the request's own sampler, keeps the proposals up to the
first that differs from what it sampled, and the sampled token after them: 1 to k+1
tokens for one trip. The rejected positions stay in the caches and the next step cuts
them back (it starts at the sequence's true position, FLAG_REUSE on its own slot), so
no message of its own is needed. This is exactly mlx-lm's speculative generator: the
emitted tokens are the target's samples, each given the true text before it.

A sequence speculates alone on its own caches (a verify step is one sequence's), so
speculation pays while few streams run; beyond `max_streams` running sequences new ones
decode in batched groups, and speculating ones move there (after a round with no
proposals, which leaves their caches exactly at their position).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from mlx_relay.model import sharding

# Consecutive rounds without an accepted proposal after which an adaptive sequence stops
# speculating and decodes in a batched group (proposals that keep failing only cost).
MISS_LIMIT = 16
EMA = 0.3  # weight of the newest round in a sequence's acceptance estimate
COST_SAMPLES = 32  # verify steps the cost line is fitted to


@dataclass(frozen=True)
class SpecConfig:
    """The server's speculative decoding settings (`--draft`, `--draft-model`, ...)."""

    source: str  # "ngram" (prompt lookup) or "model" (a draft model on rank 0)
    num_draft_tokens: int = 4  # K: the most proposals a round carries
    draft_model: str = ""  # the draft model's path or name (source "model")
    adaptive: bool = True  # K adapts to each sequence's acceptance
    max_streams: int = 2  # more running sequences than this decode in groups

    def __post_init__(self) -> None:
        if self.source not in ("ngram", "model"):
            raise ValueError(f"unknown draft source {self.source!r} (ngram or model)")
        if self.source == "model" and not self.draft_model:
            raise ValueError("a draft model source needs --draft-model")
        if self.num_draft_tokens < 1:
            raise ValueError("--num-draft-tokens must be at least 1")


@dataclass
class SpecState:
    """One speculating sequence's round state and counts."""

    k: int  # proposals the next round asks for
    limit: int  # the most it may ask for (the server's K, or the request's)
    adaptive: bool = True
    drafted: int = 0  # proposals verified so far
    accepted: int = 0  # of them accepted
    rounds: int = 0  # verify steps
    misses: int = 0  # consecutive rounds that accepted nothing
    leaving: bool = False  # the next round carries no proposals, then it joins a group
    draft: Any = None  # the drafter's own state of this sequence (a draft model's cache)
    # Recent proposals kept and refused (moving averages): a proposal's chance to be kept
    kept_rate: float = 0.0
    refused_rate: float = 0.0

    @property
    def acceptance(self) -> float:
        """The chance that a proposal is kept, given the ones before it were (each round
        keeps proposals up to the first refused one)."""
        seen = self.kept_rate + self.refused_rate
        return self.kept_rate / seen if seen else 0.5

    def record(self, proposed: int, accepted: int, cost: RoundCost | None = None) -> None:
        """A round came back: `accepted` of its `proposed` tokens were kept. The next
        round asks for as many as give the most tokens per second by `cost` (what a
        verify step of each width takes here) and this sequence's acceptance; before
        `cost` knows, more after a round that kept all and fewer after one that did not
        (the way Hugging Face's assisted generation adapts)."""
        self.rounds += 1
        self.drafted += proposed
        self.accepted += accepted
        self.misses = 0 if accepted else self.misses + 1
        if not self.adaptive or not proposed:
            return
        refused = 1 if accepted < proposed else 0
        first = not (self.kept_rate or self.refused_rate)
        weight = 1.0 if first else EMA
        self.kept_rate += weight * (accepted - self.kept_rate)
        self.refused_rate += weight * (refused - self.refused_rate)
        best = cost.best(self.acceptance, self.limit) if cost is not None else None
        if best is not None:
            self.k = best
        elif accepted == proposed:
            self.k = min(self.limit, self.k + 2)
        else:
            self.k = max(1, self.k - 1)
        if self.misses >= MISS_LIMIT:
            self.leaving = True

    def wanted(self, remaining: int) -> int:
        """Proposals for the next round: at most the tokens the request may still
        generate less the one a round always gives (as mlx-lm caps them), none while
        leaving."""
        return 0 if self.leaving else max(0, min(self.k, remaining))


def expected_tokens(proposals: int, acceptance: float) -> float:
    """Tokens a round of `proposals` gives on average: the first always, each proposal
    while every one before it was kept."""
    return sum(acceptance**i for i in range(proposals + 1))


class RoundCost:
    """What a verify step costs by its width (positions), as a line a + b x width fitted
    to the latest steps: on a GPU, or a Mac decoding a large model, a few more positions
    cost almost nothing (the weights are read once either way) and the line is flat; on
    a CPU each position costs compute, and fewer proposals give more tokens a second."""

    def __init__(self) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=COST_SAMPLES)

    def took(self, width: int, seconds: float) -> None:
        self.samples.append((width, seconds))

    def line(self) -> tuple[float, float] | None:
        """(a, b), or None until steps of two widths were timed."""
        widths = {w for w, _ in self.samples}
        if len(widths) < 2:
            return None
        n = len(self.samples)
        mean_w = sum(w for w, _ in self.samples) / n
        mean_s = sum(s for _, s in self.samples) / n
        var = sum((w - mean_w) ** 2 for w, _ in self.samples)
        cov = sum((w - mean_w) * (s - mean_s) for w, s in self.samples)
        slope = max(0.0, cov / var)
        return max(mean_s - slope * mean_w, 1e-6), slope

    def best(self, acceptance: float, limit: int) -> int | None:
        """The proposals (1..limit) giving the most tokens a second at `acceptance`, or
        None while the cost of a width is not known yet."""
        line = self.line()
        if line is None:
            return None
        a, b = line
        return max(
            range(1, limit + 1),
            key=lambda k: expected_tokens(k, acceptance) / (a + b * (k + 1)),
        )


def blocker(shard: sharding.Shard) -> str:
    """Why this model cannot speculate ('' if it can): a verify step's rejected
    positions must be cut back out of every layer's cache, which plain KV caches allow
    and recurrent states or wrapped sliding windows do not (mlx-lm refuses those too)."""
    if shard.passes == 2:
        return "its steps go round the ring twice"
    if sharding.embeds_ids(shard):
        return "its embedding reads each sequence's earlier ids"
    if shard.kv is not None:
        return "its KV caches are quantized (--kv-bits)"
    if not shard.reusable_caches or shard.cut_back_below != math.inf:
        return "its caches (recurrent state or sliding windows) cannot be cut back"
    return ""
