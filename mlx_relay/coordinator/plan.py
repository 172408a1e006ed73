"""The typed values the engine and the scheduler exchange: a step plan out, a step result in.

As in vLLM v1, the scheduler (scheduler.py) owns every request's state and the engine
(engine.py) is a loop that carries out plans and feeds results back, through two calls:

- `Scheduler.schedule() -> StepPlan`: the outputs of what happened since the last call
  (admissions, cancellations: chunks, errors, slot steps to launch first), then at most
  one forward step (`Forward`), its bookkeeping already done (positions moved on, a
  speculative round's proposals drafted), and the slot steps that must follow it;
- `Scheduler.update_from_output(StepResult) -> Outputs`: a forward step came back (its
  tokens read) or failed; the chunks for the clients and the slot steps it leads to.
  What a step took comes as a result of its own, once its tokens are streamed (the
  pace counts that time, as it always has).

Everything here is data: no ring, no device call, no lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from mlx_relay.coordinator.policy import StepOutput
from mlx_relay.coordinator.sequence import Chunk, Request, Sequence


@dataclass(frozen=True)
class PrefillChunk:
    """The next `tokens` of one sequence's prompt (with its last one: logits for token 1)."""

    seq: Sequence
    tokens: list[int]
    want_logits: bool
    reuse_from: int | None  # the parked slot its first step starts from
    position: int = 0  # where its tokens go in the sequence's caches

    @property
    def seqs(self) -> list[Sequence]:
        return [self.seq]


@dataclass(frozen=True)
class DecodeGroup:
    """One decode step of a group, fed each member's token sampled last."""

    group: int
    members: list[Sequence]
    inputs: list[mx.array]  # (1,) each, maybe not computed yet
    positions: list[int] = field(default_factory=list)  # where each input goes

    @property
    def seqs(self) -> list[Sequence]:
        return self.members


@dataclass(frozen=True)
class Verify:
    """A speculating sequence's round: its next input and the drafter's `proposed`
    tokens after it, in one step of `width` positions (1 + k, or more where a wider
    step costs less here) from its true position (the first round's input is the
    prompt's last token)."""

    seq: Sequence
    input: mx.array  # (1,), maybe not computed yet
    history: list[int]  # the sequence's every token so far, the input's value last
    k: int  # proposals asked for (before drafting), then drafted
    reuse_from: int  # the slot the step starts from: its own, cut back to its position
    proposed: mx.array | None = None  # (k,) the drafter's tokens
    width: int = 0  # positions the step carries
    position: int = 0  # where its input goes: the sequence's true position

    @property
    def seqs(self) -> list[Sequence]:
        return [self.seq]


Forward = PrefillChunk | DecodeGroup | Verify


@dataclass(frozen=True)
class Free:
    """Drop the slot's caches on every rank."""

    slot: int


@dataclass(frozen=True)
class Park:
    """Keep the slot's caches as one sequence's on every rank, for a later prompt."""

    slot: int


@dataclass(frozen=True)
class Store:
    """Write the parked slot's whole blocks not stored yet, (index, key), to every
    rank's prompt store (--prompt-cache-dir)."""

    slot: int
    blocks: tuple[tuple[int, str], ...]


@dataclass(frozen=True)
class Restore:
    """Load stored blocks into the slot on every rank, before its sequence's first
    step (which waits for this one to come back)."""

    slot: int
    keys: tuple[str, ...]


SlotAction = Free | Park | Store | Restore


@dataclass
class Outputs:
    """What the engine carries out after a call: chunks and errors for the requests'
    queues, then the slot steps to launch, in order. `finished`: the sequences that
    ended (for tests and logs)."""

    emit: list[tuple[Request, Chunk | Exception]] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    slots: list[SlotAction] = field(default_factory=list)


@dataclass
class StepPlan:
    """One call's plan: `before` (carried out first), then `forward` if any (None:
    nothing can run now), then `after`: the slot steps that must follow the forward
    step round the ring (a parked cache it copies from, evicted once it is copied)."""

    before: Outputs = field(default_factory=Outputs)
    forward: Forward | None = None
    after: list[SlotAction] = field(default_factory=list)


@dataclass(frozen=True)
class StepResult:
    """A forward step back on rank 0, or failed.

    `tokens`: the values sampled for `seqs`, those of `forward.seqs` still running when
    it came back (one a row; a verify step's, one a position), with `logprobs` where a
    request wants them, or None where nothing was read. `took`: what the step took, for
    the pace, in a result of its own once its tokens are streamed. `failed`: why it failed ('' if it did not), with
    `lost_slots`, the slots a rank failed it on (none where rank 0 failed at launch).
    `restored`: a Restore step came back from every rank."""

    forward: Forward | None  # (None: a free or park step, which serves no sequence)
    seqs: list[Sequence] = field(default_factory=list)
    tokens: list[int] | None = None
    logprobs: list[mx.array | None] = field(default_factory=list)
    took: StepOutput | None = None
    failed: str = ""
    lost_slots: list[int] = field(default_factory=list)
    restored: list[Restore] = field(default_factory=list)  # Restores done on every rank
