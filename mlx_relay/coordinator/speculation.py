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
from dataclasses import dataclass
from typing import Any

from mlx_relay.model import sharding

# Consecutive rounds without an accepted proposal after which an adaptive sequence stops
# speculating and decodes in a batched group (proposals that keep failing only cost).
MISS_LIMIT = 16
# Consecutive rounds in which the drafter had nothing to propose after which it stops
# (sooner: such a round is a plain decode step that waits for its token on the host
# before the next can launch, where a group's steps launch on tokens not yet read). A
# 128-token answer that prompt lookup never matched ran 16 such rounds under MISS_LIMIT
# alone, an eighth of its steps; on one H200, with nothing drafted, drafting on decoded
# at 0.92-0.97 of drafting off then (bench/RESULTS.md). A sequence that stops does not
# start again: an answer that begins to repeat text later is not drafted for.
EMPTY_LIMIT = 4
EMA = 0.3  # weight of the newest round in a sequence's acceptance estimate
# Wider steps each timed once after the first round, to find where padding pays.
PROBE_WIDTHS = (8, 16)


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
    empty: int = 0  # consecutive rounds the drafter proposed nothing in
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
        verify step of each width takes here) and this sequence's acceptance (none: it
        stops speculating); once, a round of none, which times one position alone;
        before `cost` knows anything, more after a round that kept all and fewer after
        one that did not (the way Hugging Face's assisted generation adapts). It stops
        after MISS_LIMIT rounds in a row that kept nothing, or EMPTY_LIMIT in which the
        drafter had nothing to propose."""
        self.rounds += 1
        self.drafted += proposed
        self.accepted += accepted
        self.misses = 0 if accepted else self.misses + 1
        self.empty = 0 if proposed else self.empty + 1
        if not self.adaptive:
            return
        if proposed:
            refused = 1 if accepted < proposed else 0
            weight = EMA if self.kept_rate or self.refused_rate else 1.0
            self.kept_rate += weight * (accepted - self.kept_rate)
            self.refused_rate += weight * (refused - self.refused_rate)
        if cost is not None and cost.seconds and 1 not in cost.seconds:
            self.k = 0  # (one position alone, timed: what proposing nothing gives)
        elif cost is not None and cost.seconds:
            best = cost.best(self.acceptance, self.limit)
            self.leaving = self.leaving or best == 0  # (alone gives more: a group's)
            self.k = max(1, best or 0)
        elif proposed:
            self.k = min(self.limit, self.k + 2) if accepted == proposed else max(1, self.k - 1)
        if self.misses >= MISS_LIMIT or self.empty >= EMPTY_LIMIT:
            self.leaving = True

    def wanted(self, remaining: int) -> int:
        """Proposals for the next round: at most the tokens the request may still
        generate less the one a round always gives (as mlx-lm caps them), none while
        leaving."""
        return 0 if self.leaving else max(0, min(self.k, remaining))


# The acceptance a load-time check credits drafting with: a round must pay at this (a
# model repeating itself, the best prompt lookup meets) or it never pays.
BEST_ACCEPTANCE = 0.95


def never_pays(seconds: dict[int, float], limit: int) -> str:
    """Why no round of 1..`limit` proposals can pay here, from a step's measured time by
    its width (1: a plain decode step's), or '' where one can: at BEST_ACCEPTANCE a
    round of k proposals gives expected_tokens(k) tokens for one step of k + 1
    positions (or of a wider measured one that costs less), against one token a step."""
    one = seconds.get(1)
    rates = {
        k: expected_tokens(k, BEST_ACCEPTANCE) * one / cheapest(seconds, k + 1)
        for k in range(1, limit + 1)
        if one and any(w >= k + 1 for w in seconds)
    }
    if not rates or max(rates.values()) > 1.0:
        return ""
    k = max(rates, key=rates.__getitem__)
    return (
        f"a verify step of {k + 1} positions costs {cheapest(seconds, k + 1) / one:.1f} "
        f"single steps here (measured at load): even with {BEST_ACCEPTANCE:.0%} of "
        f"proposals kept, drafting would decode at {rates[k]:.2f}x plain decoding"
    )


def cheapest(seconds: dict[int, float], width: int) -> float:
    """The cheapest measured step at least `width` positions wide."""
    return min(t for w, t in seconds.items() if w >= width)


def expected_tokens(proposals: int, acceptance: float) -> float:
    """Tokens a round of `proposals` gives on average: the first always, each proposal
    while every one before it was kept."""
    return sum(acceptance**i for i in range(proposals + 1))


class RoundCost:
    """What a verify step of each width (positions) takes here, measured (a moving
    average per width), never assumed: on a Mac or a GPU decoding a large model a few
    more positions cost little (the weights are read once either way); on a CPU each
    costs compute; MLX's CUDA quantized matmul computes 2 to 7 rows one matrix-vector
    product each and 8 or more as one matrix product, so there 5 positions cost more
    than 8 (bench/width_cost.py). A width not measured yet counts as what the nearest
    measured narrower one costs, so it is tried once where it might pay; PROBE_WIDTHS
    are each tried once (padded) to find a cheaper wide step."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}

    def took(self, width: int, seconds: float) -> None:
        old = self.seconds.get(width)
        self.seconds[width] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def cost(self, width: int) -> float | None:
        """The width's measured cost, else the nearest measured narrower one's (the
        narrowest measured where none is narrower); None with nothing measured."""
        if not self.seconds:
            return None
        if width in self.seconds:
            return self.seconds[width]
        narrower = [w for w in self.seconds if w < width]
        return self.seconds[max(narrower) if narrower else min(self.seconds)]

    def padded(self, width: int) -> int:
        """The width a step of `width` positions is cheapest at: itself, or a wider
        measured one that costs less (the extra positions are cut back like refused
        proposals, their logits ignored)."""
        own = self.cost(width)
        if own is None:
            return width
        unmeasured = [w for w in PROBE_WIDTHS if w > width and w not in self.seconds]
        if unmeasured and width > 1:  # (once each: whether a wider step costs less here)
            return unmeasured[0]
        cheaper = [w for w, s in self.seconds.items() if w > width and s < own]
        return min(cheaper, key=lambda w: (self.seconds[w], w)) if cheaper else width

    def best(self, acceptance: float, limit: int) -> int | None:
        """The proposals (0..limit; 0 only where one position was measured) giving the
        most tokens a second at `acceptance`, each at its cheapest width; None with
        nothing measured."""
        if not self.seconds:
            return None
        start = 0 if 1 in self.seconds else 1

        def rate(k: int) -> float:
            return expected_tokens(k, acceptance) / self.cost(self.padded(k + 1))

        return max(range(start, limit + 1), key=rate)


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
