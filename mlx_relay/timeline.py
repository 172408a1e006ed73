"""Where a step's time goes: timestamps of each rank's hot-path events, off unless asked.

With `MLX_RELAY_TIMELINE=DIR` every rank appends one line per event to
`DIR/rank<R>.tsv`: the event, the step id, `time.perf_counter_ns()` and, where the
event knows it, how many tokens the step carries (rank 0's `build`). On Linux and
macOS that clock is the machine's monotonic clock, shared by all processes on it, so the
files of ranks on one machine line up into one timeline (`bench/timeline_report.py`
reads them). On an accelerator the host's waits between events show the device's work
and the ring's hops, as the host sees them. Off, an event costs one check.
"""

from __future__ import annotations

import atexit
import os
import time
from pathlib import Path

ENV = "MLX_RELAY_TIMELINE"
_FLUSH_EVERY = 4096

_events: list[tuple[str, int, int, int]] | None = None
_path: Path | None = None


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


def flush() -> None:
    """Append the events recorded so far to this rank's file."""
    if not _events or _path is None:
        return
    lines = [f"{event}\t{step}\t{ns}\t{tokens}\n" for event, step, ns, tokens in _events]
    _events.clear()
    with _path.open("a") as f:
        f.writelines(lines)
