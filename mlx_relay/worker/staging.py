"""A worker's staging of its shard's files from rank 0 (`--stage-weights`).

CMD_STAGE hands each worker the list of its shard's units (model/shard_files.py: one
safetensors file per layer, named by the SHA-256 of its bytes) and where rank 0 serves
them. The worker passes the step on at once and stages in a background thread, so every
worker's transfer runs at the same time: a unit already in this machine's cache and
matching its digest is kept; a partial one is resumed; a missing or damaged one is
fetched (transport/blobs.py) and checked before it takes its name. Before any byte is
fetched, the disk must hold what is missing with `keep_free` bytes to spare, else the
worker refuses, naming itself and the numbers. A view directory then makes the units
look like a model to the loader; CMD_LOAD waits for it.

Progress goes to rank 0 over the side channel (control.STAGING) a few times a second:
rank 0 draws it on the launcher's log, the live page and `status`.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mlx_relay.model.default_model import cache_root
from mlx_relay.model.memory import size_text
from mlx_relay.model.shard_files import build_view
from mlx_relay.transport import blobs

log = logging.getLogger("mlx_relay.staging")

REPORT_EVERY_S = 0.25


class StagingError(RuntimeError):
    """This rank could not stage its shard (why; rank 0 names the rank)."""


@dataclass
class StageProgress:
    """What a worker tells rank 0 about its staging (control.STAGING's `staging`)."""

    id: str = ""  # the staging's (rank 0's CMD_STAGE document names it)
    state: str = "checking"  # checking -> fetching -> staged, or failed
    total: int = 0  # bytes of the rank's shard files
    ready: int = 0  # of them, on this rank's disk and checked
    fetched: int = 0  # bytes transferred by this launch
    reused: int = 0  # bytes found in the cache, checked, kept
    source: str = ""  # where they come from (rank 0's endpoint)
    cache: str = ""  # where they go
    error: str = ""
    started: float = 0.0
    seconds: float = 0.0


def shard_cache() -> Path:
    """Where this machine keeps staged units: <cache_root>/shards (MLX_RELAY_CACHE)."""
    return cache_root() / "shards"


class Stager:
    """One rank's staging, in a thread of its own; `wait()` gives the view to load."""

    def __init__(
        self,
        rank: int,
        secret: bytes,
        host: str,
        report: Callable[[dict[str, Any]], None] = lambda _: None,
    ) -> None:
        self.rank = rank
        self.secret = secret
        self.host = host  # rank 0's address, as the side channel reaches it
        self.report = report
        self.progress = StageProgress()
        self._view: Path | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._last_report = 0.0

    def start(self, document: dict[str, Any]) -> None:
        """Start staging what rank 0's CMD_STAGE document lists for this rank (an
        earlier staging still under way is stopped first: rank 0 gave up on it)."""
        self._stop.set()
        self.wait_quietly()
        self._stop = threading.Event()
        self.progress = StageProgress(id=str(document.get("id", "")), started=time.monotonic())
        self._view = None
        self._thread = threading.Thread(
            target=self._run, args=(document,), name="staging", daemon=True
        )
        self._thread.start()

    def wait(self) -> Path:
        """The staged view; StagingError where staging failed or never started."""
        if self._thread is None:
            raise StagingError(f"rank {self.rank}: rank 0 never staged this rank's shard")
        self._thread.join()
        if self._view is None:
            raise StagingError(f"staging failed: {self.progress.error}")
        return self._view

    def wait_quietly(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def _run(self, document: dict[str, Any]) -> None:
        try:
            self._view = self._stage(document)
            self.progress.state = "staged"
        except Exception as e:  # noqa: BLE001 - rank 0 hears why, and refuses the load
            self.progress.state = "failed"
            self.progress.error = str(e)
            log.error("rank %d: staging failed: %s", self.rank, e)
        self._send(force=True)

    def _stage(self, document: dict[str, Any]) -> Path:
        units: list[dict[str, Any]] = document["ranks"][str(self.rank)]
        root = shard_cache()
        store = root / "blobs"
        store.mkdir(parents=True, exist_ok=True, mode=0o700)
        p = self.progress
        endpoint = f"tcp://{self.host}:{document['port']}"
        p.source, p.cache = endpoint, str(store)
        p.total = sum(u["size"] for u in units)
        files = {u["name"]: store / f"{u['digest']}.safetensors" for u in units}
        missing = []
        # (checked several at once: hashlib lets go of the GIL, and a Mac's cores and
        # SSD check a shard of tens of GB in seconds)
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            kept = pool.map(lambda u: self._kept(files[u["name"]], u), units)
            for u, whole in zip(units, kept, strict=True):
                if whole:
                    p.ready += u["size"]
                    p.reused += u["size"]
                else:
                    missing.append(u)
                self._send()
        self._check_disk(store, missing, int(document.get("keep_free", 0)))
        p.state = "fetching"
        for u in missing:
            before = p.ready

            def moved(n: int, before: int = before) -> None:
                p.ready = before + n
                self._send()

            p.fetched += blobs.fetch(
                endpoint, self.secret, u["digest"], u["size"], files[u["name"]], moved, self._stop
            )
            p.ready = before + u["size"]
        p.seconds = time.monotonic() - p.started
        return build_view(root, document["config"], files)

    def _kept(self, path: Path, unit: dict[str, Any]) -> bool:
        """Whether `path` is the unit, whole and unchanged; a damaged one is removed."""
        if not path.exists():
            return False
        if path.stat().st_size == unit["size"] and blobs.file_digest(path) == unit["digest"]:
            return True
        log.warning("%s does not match its digest: fetching it again", path)
        path.unlink(missing_ok=True)
        return False

    def _check_disk(self, store: Path, missing: list[dict[str, Any]], keep_free: int) -> None:
        partial = sum(
            min(f.stat().st_size, u["size"])
            for u in missing
            if (f := store / f"{u['digest']}.safetensors.part").exists()
        )
        need = sum(u["size"] for u in missing) - partial
        free = shutil.disk_usage(store).free
        if need and free - keep_free < need:
            raise StagingError(
                f"its shard needs {size_text(need)} more in {store}, which has {size_text(free)} free"
                + (f" (keeping {size_text(keep_free)} free)" if keep_free else "")
            )

    def _send(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_report >= REPORT_EVERY_S:
            self._last_report = now
            self.progress.seconds = now - self.progress.started
            self.report(asdict(self.progress))
