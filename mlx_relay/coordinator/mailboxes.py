"""The byte arrays that returns handed out early are written into (returns.py).

Rank 0 builds a step's head, sampling and next step on a mailbox before the step has
come back, and writes what returns into it right before launching them. The boxes are
kept and reused rather than made for each step: on CUDA the host can write only into
managed memory, and MLX moves a device buffer there when the host first touches it,
with a copy that waits for the work queued on the GPU (~10 ms a time under load on two
H200s, bench/RESULTS.md, session 20). A box moved once stays where the host can write.

Boxes of one size take turns, `keep` of them: a box is written again only for the
`keep`-th later step of that size. With at most `keep - 1` steps in flight, that step
was launched after everything built on the box's last return had been launched, and
its return has come back, so all of that has run (rank 0's device runs what it is
given in order), and whatever the engine read of it was read within its own step.
"""

from __future__ import annotations

from collections import deque

import mlx.core as mx
import numpy as np


class Mailboxes:
    def __init__(self, keep: int) -> None:
        if keep < 2:
            raise ValueError(f"mailboxes take turns: keep {keep} is fewer than 2")
        self.keep = keep
        self._boxes: dict[int, deque[mx.array]] = {}

    def take(self, nbytes: int) -> mx.array:
        """An evaluated uint8 array of `nbytes`, which the host may write into."""
        boxes = self._boxes.setdefault(nbytes, deque())
        if len(boxes) < self.keep:
            box = mx.zeros((nbytes,), mx.uint8)
            mx.eval(box)
            np.array(box, copy=False)  # (on CUDA: moved where the host writes, once)
        else:
            box = boxes.popleft()
        boxes.append(box)
        return box

    def clear(self) -> None:
        self._boxes.clear()
