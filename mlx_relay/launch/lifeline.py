"""No rank outlives the launcher that started it, however the launcher ends.

Launchers start ranks in their own session, so that Ctrl-C reaches the launcher alone
and it can stop the ranks in order (rank 0 first, which shuts the ring down). The cost
is that nothing stops them when the launcher itself dies without doing so: `kill -9`,
or SIGHUP from a closed terminal. Two mechanisms, both ending in SIGTERM to the rank
(rank 0 then drains and stops; workers end at once):

- Linux: `prctl(PR_SET_PDEATHSIG, SIGTERM)` in the child before it runs anything; the
  kernel sends it when the parent *thread* ends, so it is set only for ranks started
  from the launcher's main thread.
- Everywhere (the only one on macOS): a lifeline pipe. The launcher keeps the write end
  (never inherited) and hands the read end to every rank it starts; a thread in the rank
  blocks reading it and gets end-of-file only when every write end is closed, that is
  when the launcher is gone. It costs no CPU and needs no polling.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

log = logging.getLogger("mlx_relay.lifeline")

LIFELINE_ENV = "MLX_RELAY_LIFELINE_FD"
_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(parent: int) -> None:
    """In a child (before exec, or forked by the zygote): SIGTERM when `parent`, the
    thread that started it, ends (Linux only)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def child_setup(*, new_session: bool = True) -> Callable[[], None]:
    """A `preexec_fn` for a rank: its own session, and on Linux the parent-death signal."""
    parent = os.getpid()
    pdeathsig = sys.platform == "linux" and threading.current_thread() is threading.main_thread()

    def setup() -> None:
        if new_session:
            os.setsid()  # Ctrl-C in the terminal reaches the launcher only
        if pdeathsig:
            set_parent_death_signal(parent)

    return setup


class Lifeline:
    """The launcher's end: a pipe whose read end every rank inherits."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()  # both non-inheritable; pass_fds passes one

    @property
    def pass_fds(self) -> tuple[int, ...]:
        """For Popen: the one descriptor a rank inherits."""
        return (self._read,)

    @property
    def env(self) -> dict[str, str]:
        """For a rank's environment: where it finds its end."""
        return {LIFELINE_ENV: str(self._read)}

    def close(self) -> None:
        """Cut the line: every rank still holding it gets SIGTERM."""
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass
        self._read = self._write = -1


def watch_launcher(on_gone: Callable[[], None] | None = None) -> bool:
    """In a rank: when the launcher is gone, call `on_gone` (default: SIGTERM to self).

    Returns False when this rank was not started with a lifeline.
    """
    raw = os.environ.pop(LIFELINE_ENV, "")  # not for any process this rank starts
    if not raw.isdigit():
        return False
    fd = int(raw)
    try:
        os.set_inheritable(fd, False)
    except OSError:
        return False  # not open here (started some other way): nothing to watch

    def gone() -> None:
        log.warning("the launcher is gone; stopping")
        os.kill(os.getpid(), signal.SIGTERM)

    def watch() -> None:
        try:
            while os.read(fd, 1):  # nobody writes: this returns only at end-of-file
                pass
        except OSError:
            pass
        (on_gone or gone)()

    threading.Thread(target=watch, name="lifeline", daemon=True).start()
    return True
