"""Rate-limited warnings for messages a listening socket drops.

Every port a rank listens on (side channel, doorbells) can receive messages that are
not from the cluster: a port scanner, a misconfigured second cluster, someone probing.
They are dropped, never acted on; but one warning per message would let a flood of
junk bury the log (and spend the rank's time writing it). So the first message dropped
from a source is logged at once, with its reason, and the rest from that source are
counted and summed up in one line per window:
"dropped 1,998 more messages from 10.0.0.7 in the last 10 s (last: ...)".
A timer writes the summary, so it comes even when the socket goes quiet afterwards and
its owner (a worker asleep until the next step) calls nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

WINDOW_ENV = "MLX_RELAY_DROP_LOG_S"  # seconds between one source's summary lines


def window_s() -> float:
    """The summary window: WINDOW_ENV's seconds, 10 when unset or not a positive number
    (a shorter one lets a test see the summary without waiting 10 s)."""
    try:
        value = float(os.environ.get(WINDOW_ENV, ""))
    except ValueError:
        return 10.0
    return value if value > 0 else 10.0


WINDOW_S = window_s()
MAX_SOURCES = 64  # beyond this many distinct sources, the rest share one entry
OTHER = "other sources"


@dataclass
class _Source:
    window_start: float
    pending: int = 0  # dropped since the last line, not yet logged
    last_reason: str = ""


def peer_of(frame: object) -> str:
    """The peer address of a zmq message (its 'Peer-Address' property), if it has one."""
    try:
        return str(frame.get("Peer-Address"))  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - not a zmq.Frame, or a peer zmq has no address for
        return "a peer of unknown address"


class DropLog:
    """Counts dropped messages per source; logs at most one line per source per window."""

    def __init__(self, logger: logging.Logger, what: str, window: float = WINDOW_S) -> None:
        self.log = logger
        self.what = what  # "side channel", "doorbell": where the messages were dropped
        self.window = window
        self.total = 0
        self.lines = 0
        self.pending = 0  # dropped but not yet in a logged line (a summary is due)
        self._sources: dict[str, _Source] = {}
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def drop(self, source: str, reason: object) -> None:
        """Note one dropped message; log it if it is the first from `source` in a window."""
        now = time.monotonic()
        with self._lock:
            self.total += 1
            if source not in self._sources and len(self._sources) >= MAX_SOURCES:
                source = OTHER
            entry = self._sources.get(source)
            if entry is None or (now - entry.window_start >= self.window and not entry.pending):
                self._sources[source] = _Source(window_start=now)
                self._emit("%s: dropped a message from %s: %s", self.what, source, reason)
                return
            entry.pending += 1
            self.pending += 1
            entry.last_reason = str(reason)
            if self._timer is None:
                self._schedule(entry.window_start + self.window - now)

    def tick(self, now: float | None = None) -> None:
        """Log the summary of every source whose window has passed (call it now and then)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._timer = None
            for source, entry in list(self._sources.items()):
                if now - entry.window_start < self.window:
                    continue
                if entry.pending:
                    self.pending -= entry.pending
                    self._emit(
                        "%s: dropped %s more messages from %s in the last %.0f s (last: %s)",
                        self.what,
                        f"{entry.pending:,}",
                        source,
                        now - entry.window_start,
                        entry.last_reason,
                    )
                    self._sources[source] = _Source(window_start=now)
                else:
                    del self._sources[source]  # quiet for a whole window: forget it
            waiting = [e.window_start for e in self._sources.values() if e.pending]
            if waiting:
                self._schedule(min(waiting) + self.window - now)

    def _schedule(self, delay: float) -> None:
        """Call tick after `delay` s (the lock is held)."""
        self._timer = threading.Timer(max(0.0, delay) + 0.01, self.tick)
        self._timer.daemon = True
        self._timer.start()

    def flush(self) -> None:
        """Log what is still counted (at close), whatever the window."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
        self.tick(time.monotonic() + self.window)
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _emit(self, fmt: str, *args: object) -> None:
        self.lines += 1
        self.log.warning(fmt, *args)


class JunkFilter(logging.Filter):
    """Turn a library's warning per junk message (uvicorn's "Invalid HTTP request
    received.") into a DropLog's rate-limited lines; other records pass unchanged."""

    def __init__(self, drops: DropLog, source: str, messages: tuple[str, ...]) -> None:
        super().__init__()
        self.drops = drops
        self.source = source
        self.messages = messages

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if any(m in message for m in self.messages):
            self.drops.drop(self.source, message)
            return False
        return True
