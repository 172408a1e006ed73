"""A rank's prompt-cache blocks on its own disk (`--prompt-cache-dir`).

A finished request's KV cache stays in its slot in RAM (the parked slots); behind them,
every rank also keeps its own layers' keys and values on disk in blocks of BLOCK_TOKENS
positions, one safetensors file a block. A block is named by a key rank 0 derives from
the tokens up to its end (coordinator/prefix_index.py), so two conversations that share
a system prompt and tools share those blocks, and a conversation's next turn writes only
its new ones. Rank 0 decides what is stored and restored; each rank does it for its
layers as the step says (CMD_STORE, CMD_RESTORE).

Nothing bad is ever loaded: a file's name carries the CRC-32 of its bytes and its header
the directory's identity (model, layer range, KV settings, format) and its own key; a
torn, truncated, flipped or foreign file fails one of them, is removed with a warning,
and the restore fails (rank 0 then prefills). The directory is named by that identity,
so another model, split or format never even looks at these files. A write that fails
(a full or read-only disk) turns writing off with one warning; serving goes on. The
byte budget holds: the least recently used blocks go first (a restore touches its
files). Only plain KV caches are kept (Shard.storable): sliding windows, recurrent
state and quantized caches are not cut into blocks.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

log = logging.getLogger("mlx_relay.prompt_store")

BLOCK_TOKENS = 128
FORMAT = "mlx-relay-kv-blocks-1"


class StoreError(RuntimeError):
    """A block that is not there, or not whole: the restore cannot go on."""


def identity(spec: dict[str, Any], rank: int) -> str:
    """What rank `rank`'s blocks depend on besides their tokens: the model's weights and
    config (sharding.fingerprint), the layers each rank holds, the tensor split, the KV
    settings (rank 0's LOAD document says all of them), the format and the block size."""
    facts = [spec["fingerprint"], spec["ranges"], spec.get("tensor", 1), spec.get("kv")]
    text = json.dumps([FORMAT, BLOCK_TOKENS, rank, *facts], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class BlockStore:
    """One rank's blocks, in `root`/<identity>, within `budget` bytes."""

    def __init__(self, root: Path, ident: str, budget: int) -> None:
        self.ident = ident
        self.budget = budget
        self.dir = Path(root).expanduser() / ident
        self.writable = True
        self.why_not = ""
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as e:
            self._stop_writing(f"cannot make {self.dir}: {e}")
        self._files: dict[str, Path] = {}  # key -> its file
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()  # (status pages read from other threads)
        self._scan()

    # --- what is here ----------------------------------------------------------------
    def _scan(self) -> None:
        if not self.dir.is_dir():
            return
        for f in self.dir.glob("*.safetensors"):
            parts = f.name.split(".")
            if len(parts) != 3 or len(parts[1]) != 8:
                continue  # (not one of ours: never read)
            self._files[parts[0]] = f
            self._sizes[parts[0]] = f.stat().st_size

    def keys(self) -> set[str]:
        with self._lock:
            return set(self._files)

    @property
    def bytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    # --- writing ---------------------------------------------------------------------
    def save(self, caches: list[Any], blocks: list[tuple[int, str]]) -> int:
        """Write blocks (index, key) of one sequence's caches (one per layer, plain KV)
        that are not here yet; returns the bytes written. Never raises: a failed write
        turns writing off (RAM-only) with one warning."""
        written = 0
        for index, key in blocks:
            if not self.writable:
                break
            if key in self._files:
                continue
            a, b = index * BLOCK_TOKENS, (index + 1) * BLOCK_TOKENS
            arrays: dict[str, mx.array] = {}
            for j, c in enumerate(caches):
                if type(c) is not KVCache or c.keys is None or c.offset < b:
                    log.warning("prompt store: block %d is not in layer %d's cache", index, j)
                    return written
                arrays[f"{j}.k"] = c.keys[..., a:b, :]
                arrays[f"{j}.v"] = c.values[..., a:b, :]
            try:
                written += self._write(key, arrays)
            except OSError as e:
                self._stop_writing(f"writing to {self.dir} failed: {e}")
        self._keep_to_budget()
        return written

    def _write(self, key: str, arrays: dict[str, mx.array]) -> int:
        buffer = io.BytesIO()
        mx.save_safetensors(
            buffer, arrays, metadata={"format": FORMAT, "key": key, "id": self.ident}
        )
        data = buffer.getvalue()
        path = self.dir / f"{key}.{zlib.crc32(data):08x}.safetensors"
        scratch = self.dir / f".{key}.{os.getpid()}.tmp"
        fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(scratch, path)
        with self._lock:
            self._files[key], self._sizes[key] = path, len(data)
        return len(data)

    def _stop_writing(self, why: str) -> None:
        if self.writable:
            log.warning("prompt store: %s; prompt caches stay in RAM only", why)
        self.writable, self.why_not = False, why

    def _keep_to_budget(self) -> None:
        """Remove the least recently used blocks while the store is over its budget."""
        total = self.bytes
        if total <= self.budget:
            return
        by_age = sorted(self._files, key=lambda k: _used_at(self._files[k]))
        for key in by_age:
            if total <= self.budget:
                break
            total -= self._sizes.get(key, 0)
            self.discard([key])

    def discard(self, keys: list[str]) -> None:
        for key in keys:
            with self._lock:
                path = self._files.pop(key, None)
                self._sizes.pop(key, None)
            if path is not None:
                path.unlink(missing_ok=True)

    # --- reading ---------------------------------------------------------------------
    def load(self, keys: list[str]) -> list[KVCache]:
        """One KV cache per layer holding the blocks `keys`, in order (positions 0 to
        len(keys) * BLOCK_TOKENS); StoreError naming what is missing or damaged (a
        damaged file is removed)."""
        per_block = [self._read(key) for key in keys]
        caches = []
        for j in range(len(per_block[0]) // 2 if per_block else 0):
            c = KVCache()
            c.keys = mx.concatenate([b[f"{j}.k"] for b in per_block], axis=2)
            c.values = mx.concatenate([b[f"{j}.v"] for b in per_block], axis=2)
            c.offset = len(keys) * BLOCK_TOKENS
            caches.append(c)
        mx.eval([(c.keys, c.values) for c in caches])
        return caches

    def _read(self, key: str) -> dict[str, mx.array]:
        path = self._files.get(key)
        if path is None:
            raise StoreError(f"prompt block {key[:12]} is not in {self.dir}")
        try:
            data = path.read_bytes()
            if f"{zlib.crc32(data):08x}" != path.name.split(".")[1]:
                raise StoreError("its bytes do not match their checksum")
            arrays, meta = mx.load(io.BytesIO(data), format="safetensors", return_metadata=True)
            if (
                meta.get("format") != FORMAT
                or meta.get("key") != key
                or meta.get("id") != self.ident
            ):
                raise StoreError("its header names another store or block")
        except (OSError, ValueError, RuntimeError) as e:
            log.warning("prompt store: %s is damaged (%s): removed", path.name, e)
            self.discard([key])
            raise StoreError(f"prompt block {key[:12]} on this rank was damaged: {e}") from e
        try:
            os.utime(path, (time.time(), path.stat().st_mtime))  # (used: last out)
        except OSError:
            pass
        return arrays


def open_for(spec: dict[str, Any], rank: int, not_storable: str) -> BlockStore | None:
    """The store rank `rank` keeps its blocks in, as rank 0's LOAD document says
    (`prompt_store`: its directory and byte budget); None where it has none, or where
    the model's caches cannot be kept (`not_storable`: why)."""
    settings = spec.get("prompt_store")
    if not settings or not_storable:
        return None
    return BlockStore(Path(settings["dir"]), identity(spec, rank), int(settings["budget"]))


def _used_at(path: Path) -> float:
    try:
        st = path.stat()
        return max(st.st_atime, st.st_mtime)
    except OSError:
        return 0.0
