"""Rank 0's side of `--stage-weights`: every worker gets its shard's files from rank 0.

Rank 0 plans the split as always, then, before CMD_LOAD, cuts each worker's share of the
checkpoint into units (model/shard_files.py: one safetensors file per layer, plus the
tensors outside every layer a worker holds), names each by the SHA-256 of its bytes,
offers them on a BlobServer (transport/blobs.py) and sends CMD_STAGE round the ring.
Every worker passes the step on at once and stages in the background
(worker/staging.py), all at the same time; rank 0 follows their reports on the side
channel, draws one progress bar per rank on its log, and goes on to CMD_LOAD when all
are staged, or fails the load naming the rank that could not stage and why.

Hashing a unit means reading it; rank 0 does that once per checkpoint: the digests are
kept in its cache (`DigestCache`), keyed by the files' sizes and modification times,
so a relaunch with the same model reads nothing to learn them.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mlx_relay.coordinator.ring_watch import RankFailure
from mlx_relay.model.default_model import cache_root
from mlx_relay.model.memory import size_text
from mlx_relay.model.shard_files import Unit, worker_units
from mlx_relay.protocol import header as hdr
from mlx_relay.transport.blobs import BlobServer
from mlx_relay.transport.hub import ControlHub

log = logging.getLogger("mlx_relay.staging")

DRAW_EVERY_S = 2.0
BAR_WIDTH = 24


class DigestCache:
    """Unit digests rank 0 has computed, by what the unit is made of (Unit.source_key),
    each with the checkpoint file it came from: an entry whose file is gone is dropped
    when the cache is read, so the file does not grow with every model ever staged."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or cache_root() / "staging" / "digests.json"
        try:
            known = json.loads(self.path.read_text())
            self._known: dict[str, dict[str, str]] = {
                key: entry for key, entry in known.items() if Path(entry["file"]).exists()
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            self._known = {}

    def digests(self, units: list[Unit]) -> list[str]:
        """Every unit's digest, in order: cached ones read from the file, the others
        hashed (several at once: hashlib lets go of the GIL) and remembered."""
        keys = [unit.source_key() for unit in units]
        todo = {k: u for k, u in zip(keys, units, strict=True) if k not in self._known}
        if todo:
            log.info("hashing %d shard files for staging (once per checkpoint)", len(todo))
            with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
                hashed = pool.map(lambda u: u.digest(), todo.values())
                for (key, unit), digest in zip(todo.items(), hashed, strict=True):
                    self._known[key] = {"digest": digest, "file": str(unit.source_file)}
            self._save()
        return [self._known[k]["digest"] for k in keys]

    def _save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            scratch = self.path.with_name(self.path.name + f".tmp{os.getpid()}")
            scratch.write_text(json.dumps(self._known))
            os.replace(scratch, self.path)
        except OSError as e:  # (hashed again next time; staging goes on)
            log.warning("could not keep the shard digests in %s: %s", self.path, e)


def stage_weights(
    command: Callable[[int, bytes], Any],
    hub: ControlHub,
    path: Path,
    ranges: list[tuple[int, int]],
    *,
    keep_free: int = 0,
    heartbeat_timeout: float = 3.0,
) -> dict[int, dict[str, Any]]:
    """Ship every worker its layers of the checkpoint at `path` (`ranges[rank]`); returns
    each worker's last staging report. `command(cmd, payload)` sends a ring command
    (RingDriver.command). RankFailure names a worker that could not stage or is gone."""
    per_rank = {rank: worker_units(path, *ranges[rank]) for rank in range(1, len(ranges))}
    all_units = [u for units in per_rank.values() for u in units]
    digests = iter(DigestCache().digests(all_units))
    server = BlobServer(hub.host, hub.secret)
    try:
        listed: dict[str, list[dict[str, Any]]] = {}
        for rank, units in per_rank.items():
            listed[str(rank)] = []
            for unit in units:
                digest = next(digests)
                server.offer(digest, unit.size, unit.read)
                listed[str(rank)].append({"name": unit.name, "digest": digest, "size": unit.size})
        document = {
            "id": os.urandom(8).hex(),  # (a report of an earlier staging is not this one's)
            "port": server.port,
            "config": (path / "config.json").read_text(),
            "keep_free": keep_free,
            "ranks": listed,
        }
        hub.clear_staging()
        command(hdr.CMD_STAGE, json.dumps(document).encode())
        return _follow(hub, len(ranges), heartbeat_timeout, server, document["id"])
    finally:
        server.close()


def _follow(
    hub: ControlHub, world_size: int, heartbeat_timeout: float, server: BlobServer, ident: str
) -> dict[int, dict[str, Any]]:
    """Wait for every worker's staging to end, drawing progress; RankFailure on a failed
    or vanished worker."""
    drawn = 0.0
    while True:
        time.sleep(0.2)
        if failure := hub.failure(heartbeat_timeout):
            raise RankFailure(failure.rank, failure.host, failure.reason, hdr.ERR_LOAD)
        ranks = hub.snapshot()
        reports = {
            r: ranks[r].staging if r in ranks and ranks[r].staging.get("id") == ident else {}
            for r in range(1, world_size)
        }
        for rank, report in reports.items():
            if report.get("state") == "failed":
                raise RankFailure(rank, ranks[rank].host, report.get("error", ""), hdr.ERR_LOAD)
        done = all(report.get("state") == "staged" for report in reports.values())
        if done or time.monotonic() - drawn >= DRAW_EVERY_S:
            drawn = time.monotonic()
            for rank, report in reports.items():
                log.info("staging rank %d (%s): %s", rank, ranks[rank].host, progress_line(report))
        if done:
            log.info("staging: %s sent by rank 0", size_text(server.sent_bytes))
            return reports


def progress_line(report: dict[str, Any]) -> str:
    """One rank's staging as a bar: bytes ready of its total, rate, time left."""
    total, ready = int(report.get("total", 0)), int(report.get("ready", 0))
    state = report.get("state", "waiting")
    fraction = ready / total if total else 0.0
    filled = int(fraction * BAR_WIDTH)
    bar = "[" + "#" * filled + "-" * (BAR_WIDTH - filled) + "]"
    seconds = float(report.get("seconds", 0.0))
    fetched = int(report.get("fetched", 0))
    rate = fetched / seconds if seconds > 0 else 0.0
    line = f"{bar} {size_text(ready)} of {size_text(total)} {state}"
    if state == "fetching" and rate > 0:
        line += f", {size_text(rate)}/s, {(total - ready) / rate:.0f} s left"
    elif state == "staged":
        kept = int(report.get("reused", 0))
        line += f" ({size_text(fetched)} fetched in {seconds:.1f} s, {size_text(kept)} kept)"
    return line
