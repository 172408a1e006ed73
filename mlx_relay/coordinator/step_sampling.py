"""What a forward step's logits become on rank 0: each row's next token, sampled as one
graph and started, not waited for (the engine reads it once the next steps are out)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mlx_relay.coordinator.plan import Forward, Verify
from mlx_relay.coordinator.sampling import sample_batch, sample_positions
from mlx_relay.coordinator.sequence import Sequence


@dataclass
class Sampled:
    """One step's sampled tokens, computed or not yet, for the sequences it served."""

    seqs: list[Sequence]
    tokens: mx.array  # (len(seqs),); a verify step's: one per position (1 + k,)
    logprobs: list[mx.array | None]  # a row's log-probabilities where its request wants them


def sample_step(
    forward: Forward, rows: list[tuple[int, Sequence]], logits: mx.array, start: bool = True
) -> Sampled:
    """mlx-lm's step for each row (sampling.sample_batch), built as one graph and started
    (unless not `start`: the caller starts it once the return it reads is settled); each
    sequence's next input is its row, still on the device. A grammar's mask is for the
    token after the one read back last, which the scheduler has moved the matcher over
    (a sequence has at most one step that wants logits in flight). A verify step's
    positions are sampled as mlx-lm's speculative generator does (sample_positions)."""
    if isinstance(forward, Verify):
        assert forward.proposed is not None
        # (positions past the proposals, where a wider step was cheaper: not sampled)
        tokens, wanted = sample_positions(logits[: forward.k + 1], forward.seq, forward.proposed)
        if start:
            mx.async_eval(tokens)
        return Sampled([forward.seq], tokens, wanted)
    if len(rows) < logits.shape[0]:
        logits = logits[mx.array([i for i, _ in rows])]
    seqs = [s for _, s in rows]
    tokens, wanted = sample_batch(logits, seqs)
    for j, seq in enumerate(seqs):
        seq.next_input = tokens[j : j + 1]
    if start:
        mx.async_eval(tokens)
    return Sampled(seqs, tokens, wanted)
