"""Stop strings on a text stream: never send any part of a stop string.

Only the tail that could still grow into a stop string is held back; everything
before it goes out at once, so streaming stays smooth while a stop string split
across tokens is still caught.
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text safe to send now; sets `stopped` when a stop string completes."""
        if self.stopped:
            return ""
        buf = self._held + text
        if not self.stops:
            self._held = ""
            return buf
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buf[: min(hits)]
        keep = self._longest_stop_prefix_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """At the end of generation the held tail was not a stop string after all."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_stop_prefix_suffix(self, buf: str) -> int:
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best
