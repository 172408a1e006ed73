"""Per-request sampling that reproduces single-process mlx-lm token for token.

mlx-lm samples with MLX's global random state, which concurrent requests would share.
Every global draw is `key, sub = split(key)` and then a draw with `sub`, so each
request here keeps its own key and splits it the same way: a seeded request gives the
tokens mlx-lm gives after `mx.random.seed(seed)`, whatever else the server is doing.
The deterministic filters (top-p, min-p, top-k) are mlx-lm's own functions.
`sample_batch` samples one step's rows together (the engine's batched sampler).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    seed: int | None = None
    ignore_eos: bool = False
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    # Speculative decoding's proposals a round may carry for this request: None as the
    # server says, 0 none (mlx_lm.server's per-request `num_draft_tokens`).
    num_draft_tokens: int | None = None


# Each float option's range, as `generation.check_sampling` holds every door's requests
# to it (inf: no upper bound). An option whose range needs the model (top_k, logit_bias
# against the vocabulary) is checked there by name.
RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0, math.inf),
    "top_p": (0, 1),
    "min_p": (0, 1),
    "xtc_probability": (0, 1),
    "xtc_threshold": (0, 0.5),
    "repetition_penalty": (0, math.inf),
    "presence_penalty": (-2, 2),  # OpenAI's range
    "frequency_penalty": (-2, 2),
}


class Sampler:
    """One request's sampler chain and random key."""

    def __init__(self, params: SamplingParams, special_token_ids: list[int] | None = None) -> None:
        self.params = params
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        self.key = mx.random.key(seed)
        self.special_token_ids = list(special_token_ids or [])
        # Bias and repetition penalty as in mlx-lm: over the context, prompt included.
        self.context_processors = make_logits_processors(
            logit_bias=params.logit_bias or None,
            repetition_penalty=params.repetition_penalty,
            repetition_context_size=params.repetition_context_size,
        )
        # Presence and frequency penalties as OpenAI documents them: over every token
        # generated so far, and nothing of the prompt.
        window = max(1, params.max_tokens)
        self.generated_processors = make_logits_processors(
            presence_penalty=params.presence_penalty,
            presence_context_size=window,
            frequency_penalty=params.frequency_penalty,
            frequency_context_size=window,
        )

    @property
    def processes(self) -> bool:
        return bool(self.context_processors or self.generated_processors)

    def _next_key(self) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return sub

    def process(
        self,
        context: list[int],
        generated: list[int],
        logits: mx.array,
        ahead: mx.array | None = None,
    ) -> mx.array:
        """The logits processors over the context (and the tokens generated), with
        `ahead`: proposed tokens after them that a verify step's position follows."""
        window, own = mx.array(context, mx.int32), mx.array(generated, mx.int32)
        if ahead is not None and ahead.size:
            window = mx.concatenate([window, ahead.astype(window.dtype)])
            own = mx.concatenate([own, ahead.astype(own.dtype)])
        for processor in self.context_processors:
            logits = processor(window, logits)
        if own.size:
            for processor in self.generated_processors:
                logits = processor(own, logits)
        return logits

    def sample(self, logprobs: mx.array) -> mx.array:
        p = self.params
        if p.temperature == 0:
            return mx.argmax(logprobs, axis=-1)
        if 0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if p.min_p != 0.0:
            logprobs = apply_min_p(logprobs, p.min_p, p.min_tokens_to_keep)
        if p.xtc_probability > 0.0:
            logprobs = self._xtc(logprobs)
        if p.top_k > 0:
            logprobs = apply_top_k(logprobs, p.top_k)
        return mx.random.categorical(logprobs * (1.0 / p.temperature), key=self._next_key())

    def _xtc(self, logits: mx.array) -> mx.array:
        """Exclude Top Choices: with probability xtc_probability drop every token above the
        threshold except the least likely of them (the same draw order as mlx-lm)."""
        p = self.params
        probs = mx.softmax(logits, -1)
        above = mx.where(probs > p.xtc_threshold, probs, mx.inf).min(axis=-1, keepdims=True)
        mask = probs > above
        if self.special_token_ids:
            mask[..., self.special_token_ids] = False
        apply = mx.random.uniform(0, 1, key=self._next_key()) <= p.xtc_probability
        return mx.where(apply, mx.where(mask, -mx.inf, logits), logits)


class Mask(Protocol):
    """A grammar's allowed next tokens (constraints.Constraint)."""

    @property
    def active(self) -> bool: ...

    def mask(self, vocab: int) -> mx.array | None: ...


class Row(Protocol):
    """What sampling reads of a sequence (sequence.Sequence)."""

    sampler: Sampler
    context: list[int]  # prompt + tokens read so far: the context processors' window
    generated: list[int]

    @property
    def constraint(self) -> Mask | None: ...


def sample_batch(logits: mx.array, rows: Sequence[Row]) -> tuple[mx.array, list[mx.array | None]]:
    """mlx-lm's step for each row of `logits` (logits processors, log-softmax, sample),
    built as one graph, not evaluated: the tokens (len(rows),), and each row's
    log-probabilities where its request wants them (None elsewhere).

    Rows that take the plain greedy token share one argmax; only requests that need their
    own work (a seed, penalties, a grammar) get a row of their own. A grammar's mask is
    applied after the logits processors, as the last of them (constraints.apply_mask); it
    is for the token after the one its matcher was moved over last.
    """
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    own_rows = [
        r.sampler.processes
        or r.sampler.params.temperature != 0
        or (r.constraint is not None and r.constraint.active)
        for r in rows
    ]
    wanted: list[mx.array | None] = [None] * len(rows)
    if not any(own_rows):
        tokens = mx.argmax(logprobs, axis=-1)
    else:
        picked = []
        for j, r in enumerate(rows):
            row = logprobs[j : j + 1]
            allowed = r.constraint.mask(logits.shape[-1]) if r.constraint is not None else None
            if r.sampler.processes or allowed is not None:
                row = logits[j : j + 1]
                if r.sampler.processes:
                    row = r.sampler.process(r.context, r.generated, row)
                if allowed is not None:
                    row = mx.where(allowed, row, -mx.inf)
                row = row - mx.logsumexp(row, keepdims=True)
            picked.append(r.sampler.sample(row))
            wanted[j] = row[0]
        tokens = mx.concatenate(picked)
    for j, r in enumerate(rows):
        if r.sampler.params.logprobs and wanted[j] is None:
            wanted[j] = logprobs[j]
    return tokens, wanted


def sample_positions(
    logits: mx.array, row: Row, proposed: mx.array
) -> tuple[mx.array, list[mx.array | None]]:
    """A verify step's k+1 positions of one sequence (logits (k+1, vocab); `proposed`:
    the k tokens it carried after its input), sampled as mlx-lm's speculative generator
    samples them: without logits processors, one draw over every position (one key);
    with them, one draw per position, processed over the context and the proposals
    before it. (A request with a grammar does not speculate: speculation.eligible.)
    The tokens (k+1,), and each position's log-probabilities where the request wants
    them."""
    sampler, count = row.sampler, logits.shape[0]
    if not sampler.processes:
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tokens = sampler.sample(logprobs)
        rows: list[mx.array] = [logprobs[i] for i in range(count)]
    else:
        picked, rows = [], []
        for i in range(count):
            row_i = sampler.process(row.context, row.generated, logits[i : i + 1], proposed[:i])
            row_i = row_i - mx.logsumexp(row_i, keepdims=True)
            picked.append(sampler.sample(row_i))
            rows.append(row_i[0])
        tokens = mx.concatenate(picked)
    wanted: list[mx.array | None] = rows if sampler.params.logprobs else [None] * count
    return tokens, wanted
