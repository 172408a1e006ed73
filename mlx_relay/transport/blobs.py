"""Byte ranges of named files from rank 0 to the workers, beside the side channel.

`--stage-weights` ships each worker its shard's files (model/shard_files.py) from rank
0. The ring cannot carry them (it reaches only a rank's neighbours, and its steps would
wait behind gigabytes), and the side channel's ROUTER keeps heartbeats on time, so
rank 0 opens one more pyzmq ROUTER for the transfer, `BlobServer`, and each worker pulls
its files with `fetch`: a window of chunk requests in flight (the link stays full; a
worker never asks for more than it has room to write), each chunk written where it
belongs, so a transfer cut off midway resumes from the bytes already on disk.

Requests are signed with the cluster secret (a stranger cannot read the weights);
replies are not: a worker checks every file against its SHA-256 before it uses it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import zmq

from mlx_relay.protocol import control

log = logging.getLogger("mlx_relay.blobs")

CHUNK = 4 * 1024 * 1024
WINDOW = 8  # chunks in flight per fetch: 32 MB, enough to fill a Thunderbolt link
REPLY_TIMEOUT_S = 60.0  # no reply for this long: rank 0 is gone or stuck
POLL_S = 0.2  # how often a waiting fetch looks whether it was stopped

Reader = Callable[[int, int], bytes]  # (offset, length) -> bytes


class FetchError(RuntimeError):
    """A file that could not be fetched whole (rank 0 refused, went silent, or the bytes
    did not match their digest)."""


class BlobServer:
    """Rank 0's end: serves byte ranges of the files it offers, by digest."""

    def __init__(self, host: str, secret: bytes) -> None:
        self.secret = secret
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        self._blobs: dict[str, tuple[int, Reader]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.sent_bytes = 0
        self._thread = threading.Thread(target=self._serve, name="blob-server", daemon=True)
        self._thread.start()

    def offer(self, digest: str, size: int, reader: Reader) -> None:
        with self._lock:
            self._blobs[digest] = (size, reader)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            frames = self._sock.recv_multipart()
            identity, request = frames[0], frames[1:]
            try:
                asked = json.loads(control.verify(request, self.secret))
                digest, offset, length = asked["blob"], int(asked["offset"]), int(asked["length"])
                with self._lock:
                    size, reader = self._blobs[digest]
                if not (0 <= offset <= size and 0 < length <= CHUNK):
                    raise ValueError(f"range {offset}+{length} outside its {size} bytes")
                data = reader(offset, min(length, size - offset))
            except (control.BadMessage, ValueError, KeyError, TypeError, OSError) as e:
                reason = f"not offered: {e}" if isinstance(e, KeyError) else str(e)
                log.warning("blob server: refused a request: %s", reason)
                self._sock.send_multipart([identity, b"error", reason.encode(), b""])
                continue
            self._sock.send_multipart([identity, b"ok", str(offset).encode(), data], copy=False)
            self.sent_bytes += len(data)


def fetch(
    endpoint: str,
    secret: bytes,
    digest: str,
    size: int,
    into: Path,
    progress: Callable[[int], None] = lambda _: None,
    stop: threading.Event | None = None,
) -> int:
    """Fetch the file `digest` of `size` bytes from rank 0 into `into`, resuming the
    partial file `into`.part where an earlier fetch stopped; the whole file is checked
    against `digest` before it takes its name. Returns the bytes transferred;
    `progress(n)` is told of every chunk written; `stop` set ends it (FetchError), the
    bytes so far kept for the next one. Ranks of one machine that need the same file (a
    stage's peers in a stage x tensor grid) fetch it one at a time: the second finds it
    there and moves nothing (they shared one part file, and the second's rename failed)."""
    with _alone(into):
        if into.exists() and into.stat().st_size == size:  # (another rank fetched it)
            progress(size)
            return 0
        return _fetch(endpoint, secret, digest, size, into, progress, stop)


@contextlib.contextmanager
def _alone(into: Path) -> Iterator[None]:
    """Hold this machine's lock on fetching `into` (a lock file beside it, released
    when closed, by a process that ended too)."""
    fd = os.open(into.with_name(into.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.fchmod(fd, 0o600)  # (as the part file: the serving user's alone)
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _fetch(
    endpoint: str,
    secret: bytes,
    digest: str,
    size: int,
    into: Path,
    progress: Callable[[int], None],
    stop: threading.Event | None,
) -> int:
    part = into.with_name(into.name + ".part")
    fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.fchmod(fd, 0o600)  # (the serving user's alone, whoever made the part file)
        have = min(os.fstat(fd).st_size, size)
        os.ftruncate(fd, have)
        h = _Hasher()
        for block in iter(lambda: os.read(fd, CHUNK), b""):  # (the bytes already here)
            h.update(block)
        progress(have)
        try:
            moved = _pull(endpoint, secret, digest, size, have, fd, h, progress, stop)
        finally:
            got = h.hexdigest()
        if got != digest:
            os.close(fd)
            fd = -1
            part.unlink(missing_ok=True)
            raise FetchError(f"{into.name}: the bytes received do not match their digest")
        # (no fsync: a file a crash tore no longer matches its digest, which every use
        # checks first, and is fetched again)
    finally:
        if fd >= 0:
            os.close(fd)
    os.replace(part, into)
    return moved


def _pull(
    endpoint: str,
    secret: bytes,
    digest: str,
    size: int,
    offset: int,
    fd: int,
    h: _Hasher,
    progress: Callable[[int], None],
    stop: threading.Event | None,
) -> int:
    """Request `size - offset` bytes a window of chunks at a time, writing and hashing
    them in order."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    asked = written = offset
    try:
        while written < size:
            while asked < size and asked - written < WINDOW * CHUNK:
                length = min(CHUNK, size - asked)
                request = json.dumps({"blob": digest, "offset": asked, "length": length})
                sock.send_multipart(control.sign(request.encode(), secret))
                asked += length
            waited = 0.0
            while not sock.poll(int(POLL_S * 1000)):
                waited += POLL_S
                if stop is not None and stop.is_set():
                    raise FetchError("stopped: rank 0 started another staging")
                if waited >= REPLY_TIMEOUT_S:
                    raise FetchError(f"no reply from rank 0 in {REPLY_TIMEOUT_S:.0f} s")
            status, where, frame = sock.recv_multipart(copy=False)[:3]
            if status.bytes != b"ok":
                raise FetchError(f"rank 0 refused: {where.bytes.decode(errors='replace')}")
            if int(where.bytes) != written:  # (one connection, one server thread: in order)
                raise FetchError(f"chunk at {int(where.bytes)} arrived when {written} was due")
            data = frame.buffer
            os.pwrite(fd, data, written)
            h.update(data)
            written += len(data)
            progress(written)
    finally:
        sock.close(linger=0)
    return written - offset


class _Hasher:
    """SHA-256 in a thread of its own, so that hashing a chunk overlaps receiving and
    writing the next (hashlib lets go of the GIL; where the CPU has no SHA instructions
    hashing is the slowest part of a fetch)."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=WINDOW)
        self._thread = threading.Thread(target=self._run, name="fetch-hash", daemon=True)
        self._thread.start()

    def update(self, data: Any) -> None:
        self._queue.put(data)

    def hexdigest(self) -> str:
        self._queue.put(None)
        self._thread.join()
        return self._h.hexdigest()

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            self._h.update(data)


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes (a cached unit, checked before each use)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()
