"""The one hold-back rule of a text stream: never send what may still turn out to be a
stop string or a piece of markup.

Only the tail that could still grow into one of the watched strings is held back;
everything before it goes out at once, so streaming stays smooth while a stop string or
a marker split across tokens is still caught. The output parser (postprocess.py) keeps
one buffer and applies this rule to the stop strings and to whichever markers its state
watches for, at the same time.
"""

from __future__ import annotations

from collections.abc import Iterable


def held_back(text: str, patterns: Iterable[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a pattern."""
    best = 0
    for pattern in patterns:
        for n in range(min(len(pattern) - 1, len(text)), best, -1):
            if text.endswith(pattern[:n]):
                best = n
                break
    return best


def first_match(text: str, patterns: Iterable[str], start: int = 0) -> tuple[int, str] | None:
    """The earliest complete pattern in ``text[start:]`` (the longest one on a tie)."""
    best: tuple[int, str] | None = None
    for pattern in patterns:
        i = text.find(pattern, start)
        if i < 0:
            continue
        if best is None or i < best[0] or (i == best[0] and len(pattern) > len(best[1])):
            best = (i, pattern)
    return best
