"""The engine's counters, in one object: what /metrics, the status RPC and the live page read.

Written by the engine thread only (forward steps as they come back, speculative rounds
as they are verified); other threads read copies (`steps`, `rounds`), never the dicts
being written.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepCount:
    """Forward steps of one kind so far: how many, their seconds from launch to back on
    rank 0, and the tokens they carried (prompt tokens prefilled, tokens decoded)."""

    steps: int
    seconds: float
    tokens: int


@dataclass(frozen=True)
class RoundCount:
    """Speculative rounds so far: verify steps, proposals they carried, those kept."""

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0


@dataclass(frozen=True)
class PromptCount:
    """Prompt tokens of requests whose prefill finished, and those a cache served: from
    the parked slots (RAM) or from stored blocks (disk, --prompt-cache-dir)."""

    tokens: int = 0
    from_ram: int = 0
    from_disk: int = 0


@dataclass
class EngineStats:
    _counts: dict[str, int] = field(default_factory=dict)
    _seconds: dict[str, float] = field(default_factory=dict)
    _tokens: dict[str, int] = field(default_factory=dict)
    _rounds: RoundCount = field(default_factory=RoundCount)
    _prompts: PromptCount = field(default_factory=PromptCount)

    def step(self, kind: str, seconds: float, tokens: int) -> None:
        """One forward step of `kind` came back after `seconds`, carrying `tokens`."""
        self._counts[kind] = self._counts.get(kind, 0) + 1
        self._seconds[kind] = self._seconds.get(kind, 0.0) + seconds
        self._tokens[kind] = self._tokens.get(kind, 0) + tokens

    def round(self, proposed: int, accepted: int) -> None:
        """A speculative round came back: `accepted` of its `proposed` tokens kept."""
        r = self._rounds
        self._rounds = RoundCount(r.rounds + 1, r.proposed + proposed, r.accepted + accepted)

    def prompt(self, tokens: int, cached: int, from_disk: bool) -> None:
        """A request's prefill finished: `tokens` prompt tokens, `cached` of them from a
        cache, stored blocks when `from_disk`, else a parked slot."""
        p = self._prompts
        ram, disk = (0, cached) if from_disk else (cached, 0)
        self._prompts = PromptCount(p.tokens + tokens, p.from_ram + ram, p.from_disk + disk)

    def prompts(self) -> PromptCount:
        return self._prompts

    def steps(self) -> dict[str, StepCount]:
        """Forward steps by kind (prefill, decode, verify)."""
        counts, seconds, tokens = dict(self._counts), dict(self._seconds), dict(self._tokens)
        return {
            kind: StepCount(n, seconds.get(kind, 0.0), tokens.get(kind, 0))
            for kind, n in counts.items()
        }

    def rounds(self) -> RoundCount:
        return self._rounds
