"""Where a step's time goes: timestamps of each rank's hot-path events, off unless asked.

With `MLX_RELAY_TIMELINE=DIR` every rank appends one line per event to
`DIR/rank<R>.tsv`: the event, the step id, `time.perf_counter_ns()` and, where the
event knows it, how many tokens the step carries (rank 0's `build`). On Linux and
macOS that clock is the machine's monotonic clock, shared by all processes on it, so the
files of ranks on one machine line up into one timeline (`bench/timeline_report.py`
reads them). On an accelerator the host's waits between events show the device's work
and the ring's hops, as the host sees them; `mark_when_computed` adds when the device
finished an array (a payload sent or received, the sampled tokens), seen from a watcher
thread. Off, an event costs one check.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

ENV = "MLX_RELAY_TIMELINE"
_FLUSH_EVERY = 4096

_events: list[tuple[str, int, int, int]] | None = None
_path: Path | None = None
_watchers: dict[str, queue.SimpleQueue] = {}  # event -> its watcher thread's queue
_writing = threading.Lock()


def start(rank: int) -> None:
    """Record this process's events as rank `rank`'s, if the environment asks for it."""
    global _events, _path
    folder = os.environ.get(ENV)
    if not folder:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    _path = Path(folder) / f"rank{rank}.tsv"
    _events = []
    atexit.register(flush)


def mark(event: str, step: int, tokens: int = 0) -> None:
    """Record that `event` of step `step` happened now (nothing unless started)."""
    if _events is None:
        return
    _events.append((event, step, time.perf_counter_ns(), tokens))
    if len(_events) >= _FLUSH_EVERY:
        flush()


def mark_when_computed(event: str, step: int, array: Any) -> None:
    """Record `event` of step `step` when the device has computed `array` (an MLX array
    launched already), as a watcher thread of the event's own sees it: a one-element
    probe of it is launched after it and waited for there. Only while recording: the
    probe is a small extra evaluation on the device's stream."""
    if _events is None:
        return
    import mlx.core as mx  # (only while recording)

    probe = array.reshape(-1)[:1].astype(mx.float32)
    mx.async_eval(probe)
    if event not in _watchers:
        _watchers[event] = queue.SimpleQueue()
        threading.Thread(target=_watch, args=(event,), daemon=True).start()
    _watchers[event].put((step, probe))


def _watch(event: str) -> None:
    import mlx.core as mx

    while True:
        step, probe = _watchers[event].get()
        mx.eval(probe)  # (only waits, with Python's lock let go; no copy to the host)
        mark(event, step)


def flush() -> None:
    """Append the events recorded so far to this rank's file."""
    with _writing:  # (watcher threads mark, and may flush, too)
        if not _events or _path is None:
            return
        taken = _events[:]
        del _events[: len(taken)]
        lines = [f"{event}\t{step}\t{ns}\t{tokens}\n" for event, step, ns, tokens in taken]
        with _path.open("a") as f:
            f.writelines(lines)
