"""Teacher forcing: whether emitted greedy tokens are the ones a model would choose.

bench/greedy_under_load.py checks every token of a busy cluster's greedy streams with it
(the oracle of its CUDA check); tests/test_hops.py checks that it catches a swapped token.
"""

from __future__ import annotations

import mlx.core as mx


def misses(model, prompt: list[int], output: list[int]) -> tuple[list[tuple[int, float]], float]:
    """(position, gap) of each emitted token that is not the teacher-forced argmax, and
    the median margin of the argmax over the runner-up (the scale a gap is read on)."""
    logits = model(mx.array([prompt + output[:-1]]))[0, len(prompt) - 1 :].astype(mx.float32)
    best = mx.argmax(logits, axis=-1)
    emitted = mx.array(output)
    top2 = mx.sort(logits, axis=-1)[:, -2:]
    margin = float(mx.median(top2[:, 1] - top2[:, 0]).item())
    gap = mx.max(logits, axis=-1) - mx.take_along_axis(logits, emitted[:, None], -1)[:, 0]
    wrong = (best != emitted).tolist()
    gaps = gap.tolist()
    return [(p, gaps[p]) for p, w in enumerate(wrong) if w], margin
