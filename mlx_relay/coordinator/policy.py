"""Scheduling policy: rules that need no ring, no device and no request: data in, data out.

The scheduler (scheduler.py) owns the requests' state; it asks these rules what runs
next and tells them what happened, so they can be read and unit-tested on their own
(tests/test_scheduler.py). `Policy` is their interface:

- `Policy.schedule(units, decoding)`: of the `Unit`s runnable now, the one to launch
  next and what its step carries (`Scheduled`: a prompt chunk's size, whether it needs
  logits), or None;
- `Policy.update_from_output(StepOutput)`: what a finished step took, which paces the
  next prompt chunks.

It is built from these rules:

- `PrefillPacer`: how many prompt tokens the next prefill chunk carries, sized by time
  on every path: alone, what costs about CHUNK_TARGET_S at the measured pace (at most
  `--prefill-chunk` tokens, as mlx-lm prefills, which a GPU reaches at once), so that no
  step on a slow machine runs for minutes and a short request gets in between the
  chunks of a long one; beside running streams, what costs about STALL_STEPS decode
  steps, so a long prompt delays every running stream by at most that much per token
  instead of one long stall. Cost counts the context (pace.step_cost): a chunk deep in
  a long prompt is smaller than the first. The first chunk after a load is a probe of
  PROBE_CHUNK tokens, which measures the pace.
- `pick_group`: which decode group a sequence joins after its first token.
- `next_unit`: which runnable unit (a decode group, a prefill) goes round the ring next;
  units take turns so that no prompt starves the streams, nor the streams a prompt.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from mlx_relay.coordinator.pace import tokens_within

STALL_STEPS = 4  # a prefill chunk beside running streams costs about this many decode steps
CHUNK_TARGET_S = 2.0  # a prefill chunk alone costs about this long (from when it can start)
MIN_CHUNK = 8  # tokens: below this a chunk's fixed costs dominate
PROBE_CHUNK = 32  # a chunk's size before any prefill was timed
EMA = 0.3  # weight of the newest measurement in the step-time averages

T = TypeVar("T")


class PrefillPacer:
    """Chunk sizes from the measured pace of decode steps and of prefilled work."""

    def __init__(self, prefill_chunk: int, hidden: int = 0, fixed_alone: bool = False) -> None:
        self.prefill_chunk = prefill_chunk
        self.hidden = hidden  # the model's hidden size: how much context costs (pace.py)
        # Alone, a chunk is `--prefill-chunk` tokens, as mlx-lm's prefill_step_size: with
        # quantized KV caches, where chunk boundaries change what the caches hold.
        self.fixed_alone = fixed_alone
        self.decode_step_s = 0.0  # moving average of a decode group's step, launch to read
        self.prefill_unit_s = 0.0  # moving average of a unit of prompt work (pace.step_cost)

    def chunk_size(self, decoding: bool, position: int = 0) -> int:
        """The next chunk of a prompt whose first `position` tokens are sent: what costs
        CHUNK_TARGET_S, or while streams decode STALL_STEPS of their steps, at most
        `--prefill-chunk`; PROBE_CHUNK until a chunk was timed."""
        beside = decoding and bool(self.decode_step_s)
        if self.fixed_alone and not beside:
            return self.prefill_chunk
        if not self.prefill_unit_s:
            return min(self.prefill_chunk, PROBE_CHUNK)
        budget = STALL_STEPS * self.decode_step_s if beside else CHUNK_TARGET_S
        fits = tokens_within(budget / self.prefill_unit_s, position, self.hidden)
        return max(MIN_CHUNK, min(self.prefill_chunk, fits))

    def decode_step_took(self, seconds: float) -> None:
        """A decode step with no prefill beside it: the pace a stream keeps undisturbed."""
        self.decode_step_s = _average(self.decode_step_s, seconds)

    def prefill_chunk_took(self, seconds: float, tokens: int, units: float) -> None:
        """A prefill chunk (not the last prompt token's step) of `units` took `seconds`
        from when it could start; tiny chunks say little."""
        if tokens >= MIN_CHUNK and units > 0:
            self.prefill_unit_s = _average(self.prefill_unit_s, seconds / units)


def pick_group(sizes: Sequence[int], capacity: int) -> int:
    """The decode group a new stream joins: the smallest one with room (the first of
    equals), so groups stay even and each step's batch stays small."""
    loads = [n if n < capacity else math.inf for n in sizes]
    return loads.index(min(loads))


def next_unit(units: Sequence[T], turn: int) -> T:
    """Round robin over the units runnable now (their order is stable between calls)."""
    return units[turn % len(units)]


@dataclass(frozen=True)
class Unit:
    """Work that can go round the ring now: a decode group, or one sequence's prompt."""

    kind: str  # "group", "prefill" or "verify" (a speculating sequence's round)
    key: Any  # the group's index, or the scheduler's sequence
    pending: int = 0  # prompt tokens still to send (a prefill)
    # the prompt goes in one step, its last token in it (gemma4's image prompts: its
    # image tokens attend to each other only in an unchunked prefill, as in mlx-vlm)
    whole: bool = False
    position: int = 0  # prompt tokens already sent (a prefill): their context costs


@dataclass(frozen=True)
class Scheduled:
    """The next step: which unit, how many prompt tokens (1 a row for a decode group), and
    whether its logits are wanted (a decode step, or a prompt's last token)."""

    unit: Unit
    tokens: int
    want_logits: bool


@dataclass(frozen=True)
class StepOutput:
    """What came back from a forward step, as far as scheduling cares."""

    kind: str  # "group", "prefill" or "verify"
    seconds: float  # a decode step: launch to completion; a prefill: from when it could start
    tokens: int = 0  # prompt tokens a prefill step carried
    units: float = 0.0  # its work (pace.step_cost)
    want_logits: bool = True
    beside_prefill: bool = False  # a prompt was being prefilled while it ran


class Policy:
    """What runs next, from what is runnable and what the last steps took."""

    def __init__(self, prefill_chunk: int) -> None:
        self.pacer = PrefillPacer(prefill_chunk)
        self._turn = 0

    def reset(self, hidden: int, fixed_alone: bool = False) -> None:
        """A model was loaded (hidden size `hidden`): its pace is still to be measured.
        `fixed_alone`: a prompt alone goes in `--prefill-chunk` chunks (quantized KV
        caches: see PrefillPacer)."""
        self.pacer = PrefillPacer(self.pacer.prefill_chunk, hidden, fixed_alone)

    def schedule(self, units: Sequence[Unit], decoding: bool) -> Scheduled | None:
        """The unit to launch next (units take turns) and its step, or None if none can run.

        ``decoding``: streams are running, so a prompt chunk is paced beside them. A prompt
        is sent in chunks up to its last token, which goes alone: its logits give token 1
        (a `whole` prompt goes in one step with its last token).
        """
        if not units:
            return None
        unit = next_unit(units, self._turn)
        self._turn += 1
        if unit.kind in ("group", "verify"):  # (a verify's proposals: the engine's)
            return Scheduled(unit, 1, True)
        if unit.pending <= 1 or unit.whole:
            return Scheduled(unit, max(1, unit.pending), True)
        chunk = self.pacer.chunk_size(decoding, unit.position)
        return Scheduled(unit, min(chunk, unit.pending - 1), False)

    def update_from_output(self, out: StepOutput) -> None:
        """Fold a finished step's duration into the averages the chunk size comes from."""
        if out.kind == "group":
            # Only steps with no prefill beside them: the pace a stream keeps undisturbed.
            if not out.beside_prefill:
                self.pacer.decode_step_took(out.seconds)
        elif not out.want_logits:
            self.pacer.prefill_chunk_took(out.seconds, out.tokens, out.units)


def _average(old: float, new: float) -> float:
    return new if not old else (1 - EMA) * old + EMA * new
