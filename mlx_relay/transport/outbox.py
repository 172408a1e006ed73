"""An outbox: a rank's messages to its right neighbour, in order, some sent only once
the payload they carry is computed, from a thread of the outbox's own.

Why a thread: the last rank of an ADAPTIVE pair under load returns each step's output
in its header's message (FLAG_INLINE_BACK, ring.py) instead of over MLX's ring. A ring
send on CUDA runs on a CPU stream, and every CPU stream's evaluation signals an event
that MLX keeps in managed memory and frees with a `cudaFree`, which waits for the whole
GPU: the worker's host waited for its own layers after every step, and where MLX's
stream thread freed it instead, the main thread's CUDA calls waited as long
(bench/RESULTS.md, session 17). Read
here instead, the output is waited for with an ordinary CUDA event on this thread (MLX
lets go of Python's lock while it waits), copied to the host and sent, while the
rank's main thread already builds and launches the next step.

Every message to the neighbour goes through one outbox, so they leave in the order they
were posted: straight away when nothing is pending, else after what is.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

log = logging.getLogger("mlx_relay.outbox")

Message = bytes | Callable[[], bytes]  # ready, or made on the outbox's thread


class Outbox:
    def __init__(self, send: Callable[[bytes], None], name: str = "outbox") -> None:
        self._send = send
        self._name = name
        self._ready = threading.Condition()
        self._queue: deque[Message] = deque()
        self._sending = False  # the thread holds a message it took off the queue
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def post(self, message: Message) -> None:
        """Send `message` after everything posted before it: here and now if nothing is
        pending and it is ready, else on the outbox's thread (a callable is called there,
        and what it returns is sent). Raises what a message sent earlier on the thread
        raised, once."""
        with self._ready:
            self._raise_failure()
            if isinstance(message, bytes) and not self._queue and not self._sending:
                self._send(message)
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._queue.append(message)
            self._ready.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every posted message has been sent; False if `timeout` ran out.
        Raises what a message sent on the thread raised."""
        with self._ready:
            done = self._ready.wait_for(
                lambda: self._failure is not None or (not self._queue and not self._sending),
                timeout,
            )
            self._raise_failure()
            return done

    def close(self) -> None:
        """Stop the thread once what is queued has been sent."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure

    def _run(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                message = self._queue.popleft()
                self._sending = True
            try:
                data = message if isinstance(message, bytes) else message()
                with self._ready:  # (a post from the main thread waits its turn)
                    self._send(data)
            except BaseException as e:  # noqa: BLE001 - handed to the next post or drain
                log.debug("%s: a message failed: %s", self._name, e)
                with self._ready:
                    self._failure = e
                    self._queue.clear()
            finally:
                with self._ready:
                    self._sending = False
                    self._ready.notify_all()
