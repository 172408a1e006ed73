"""How long a step should take: its cost, this cluster's measured pace, and its deadline.

A prompt chunk of 512 tokens takes a GPU 60 ms and a small CPU rank 50 s; a fixed step
timeout cannot serve both, so the step watchdog (Pipeline.overdue) and the prefill pacer
(scheduler.PrefillPacer) measure instead of guessing:

- `step_cost`: a forward step's work in *units*, one unit being one token through the
  weights. Attention adds work that grows with the context (for a decoder with hidden
  size h a token's weights cost about 24 h^2 flops per layer, its attention over c
  earlier positions about 4 c h more), so a token at context c costs
  1 + c / (6 h) units (CONTEXT_SCALE = 6): a chunk deep into a long prompt costs what it
  is, not what the first chunk did.
- `StepPace`: the seconds per unit and per step this cluster has taken, as a cautious
  estimate (a slow step raises it at once, fast ones lower it slowly), and from it a
  step's *allowance*: `--step-timeout` plus SLACK times what the step should take on
  every rank (`ranks`: a step timed while others fill the pipeline costs one rank's
  share of the ring, and one alone every rank's).
- `tokens_within`: the longest prompt chunk that fits a time budget at the measured
  pace (the prefill pacer's chunk size).

A step of a shape the cluster has not run since its load may first compile kernels
(CUDA's JIT compiles a quantized matmul at its first use at a new size, Metal builds its
pipelines): on a fresh H100 machine a 2-rank cluster's second step took over 30 s. Such
a step is allowed at least FIRST_SHAPE_S (`step_shape` says which steps share a shape).

A step is timed from when it could start: once the step before it was done with (steps
go round the ring in order, so a chunk queued behind three others is not late for
having waited), or when it was launched, whichever is later.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

CONTEXT_SCALE = 6.0  # a token at context c costs 1 + c / (CONTEXT_SCALE * hidden) units
SLACK = 4.0  # a step may take this many times its expected time, beyond --step-timeout
DECAY = 0.9  # a faster step lowers the estimate only this far towards it (a slower: at once)
LARGE_STEP_UNITS = 16.0  # steps at least this big measure the per-unit rate
FIRST_SHAPE_S = 120.0  # the least a step of a shape not run since the load is allowed


def step_shape(lengths: Sequence[int]) -> tuple[int, int]:
    """What a step's kernels are compiled for, roughly: its rows, and its widest row's
    tokens rounded up to a power of two."""
    widest = max(lengths, default=1)
    return len(lengths), 1 << max(0, widest - 1).bit_length()


def step_cost(lengths: Sequence[int], offsets: Sequence[int], hidden: int) -> float:
    """The work of a forward step, in units (see the module): each row's `lengths[i]`
    new tokens after `offsets[i]` earlier positions."""
    scale = CONTEXT_SCALE * max(1, hidden)
    return float(
        sum(
            n * (1.0 + (offset + n / 2.0) / scale)
            for n, offset in zip(lengths, offsets, strict=True)
        )
    )


def _cautious(old: float, new: float) -> float:
    """Up at once, down slowly: the estimate errs towards patience."""
    if not old or new >= old:
        return new
    return DECAY * old + (1.0 - DECAY) * new


class StepPace:
    """What a forward step costs this cluster: a fixed part per step (`step_s`: hops,
    launches, the head) and a part per unit of work (`unit_s`), both measured."""

    def __init__(self) -> None:
        self.step_s = 0.0  # a small step's whole time (decode steps, tiny chunks)
        self.unit_s = 0.0  # seconds per unit beyond the fixed part, from large steps

    @property
    def measured(self) -> bool:
        return bool(self.step_s or self.unit_s)

    def observe(self, units: float, seconds: float) -> None:
        """A forward step of `units` took `seconds` from when it could start."""
        if seconds <= 0:
            return
        if units < LARGE_STEP_UNITS:
            self.step_s = _cautious(self.step_s, seconds)
            return
        per_unit = max(seconds - self.step_s, seconds / 2.0) / units
        self.unit_s = _cautious(self.unit_s, per_unit)

    def expected(self, units: float) -> float:
        """Seconds a step of `units` should take; 0 before anything was measured. A
        step larger than any measured yet is costed at the small steps' per-unit rate
        where no large step has been seen (patient: that rate includes fixed costs)."""
        if not self.measured:
            return 0.0
        rate = self.unit_s or self.step_s / max(1.0, LARGE_STEP_UNITS / 2.0)
        return self.step_s + units * rate

    def allowance(
        self, units: float, floor: float, ranks: int = 1, new_shape: bool = False
    ) -> float:
        """How long a step of `units` may take, from when it could start, before the
        rank holding it counts as stuck: `floor` (--step-timeout) plus SLACK times its
        expected time on each of the `ranks` (all of whose shares may be ahead of it);
        at least FIRST_SHAPE_S for a `new_shape` (its kernels may compile first)."""
        allowed = floor + SLACK * max(1, ranks) * self.expected(units)
        return max(allowed, FIRST_SHAPE_S) if new_shape else allowed


def tokens_within(units: float, offset: int, hidden: int) -> int:
    """The most prompt tokens after `offset` earlier positions whose `step_cost` is at
    most `units` (solving n (1 + (offset + n / 2) / s) = units for n, s the context
    scale); at least 1."""
    if units <= 0:
        return 1
    scale = CONTEXT_SCALE * max(1, hidden)
    b = 1.0 + offset / scale
    n = scale * (math.sqrt(b * b + 2.0 * units / scale) - b)
    return max(1, int(n + 1e-6))  # (1e-6: 79.99999 tokens of rounding are 80)
