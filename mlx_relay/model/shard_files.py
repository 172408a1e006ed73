"""The files a worker loads its stage from when rank 0 ships them (`--stage-weights`).

A worker's share of a checkpoint is cut into units: one per decoder layer, and one for
the tensors outside every layer that a worker's stage still holds (most models have
none: the embedding, final norm and LM head are rank 0's). Each unit is a safetensors
file of its own, composed from rank 0's checkpoint without loading it: a header written
here, then each tensor's bytes copied from where they lie in rank 0's files. A unit is
named by the SHA-256 of its bytes, so a worker keeps units by content: a second launch
with the same model and split finds every one, another split fetches only the layers a
worker lacks, and a file with a flipped byte no longer matches its name.

On the worker, a view directory (`build_view`) makes the units look like a model to
mlx-lm's loader: the model's config.json and one `model-<unit>.safetensors` link per
unit. The worker's loader then takes what is there (`sharding.load_shard(...,
partial=True)`) and keeps only its own layers, as it always does.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_relay.model import checkpoint, sharding, vision
from mlx_relay.model.families import adapter_of

# Bumped whenever the composed files change, so that no older unit is ever taken for one.
UNIT_FORMAT = 1
READ_CHUNK = 8 * 1024 * 1024
GLOBAL_UNIT = "stage"


@dataclass(frozen=True)
class Unit:
    """One composed safetensors file: its name in a view, its header, and where each of
    its tensors' bytes lie in rank 0's checkpoint."""

    name: str  # "layer-00012", or GLOBAL_UNIT
    tensors: tuple[tuple[str, checkpoint.Tensor], ...]
    header: bytes  # the 8-byte length, then the JSON header

    @property
    def size(self) -> int:
        return len(self.header) + sum(t.nbytes for _, t in self.tensors)

    @property
    def source_file(self) -> Path | None:
        """The checkpoint file its first tensor lies in."""
        return self.tensors[0][1].file if self.tensors else None

    def chunks(self, offset: int = 0, chunk: int = READ_CHUNK) -> Iterator[bytes]:
        """The unit's bytes from `offset` on, read from the checkpoint a chunk at a time
        (rank 0's memory does not grow with the model)."""
        if offset < len(self.header):
            yield self.header[offset:]
        position = len(self.header)
        for _, t in self.tensors:
            end = position + t.nbytes
            if end > offset:
                skip = max(0, offset - position)
                with open(t.file, "rb") as fh:  # type: ignore[arg-type]
                    fh.seek(t.offset + skip)
                    left = t.nbytes - skip
                    while left > 0:
                        data = fh.read(min(chunk, left))
                        if not data:
                            raise OSError(f"{t.file} ends before its tensors do")
                        left -= len(data)
                        yield data
            position = end

    def read(self, offset: int, length: int) -> bytes:
        """`length` bytes of the unit from `offset` (fewer at its end)."""
        parts: list[bytes] = []
        got = 0
        for data in self.chunks(offset, chunk=min(length, READ_CHUNK)):
            parts.append(data[: length - got])
            got += len(parts[-1])
            if got >= length:
                break
        return b"".join(parts)

    def digest(self) -> str:
        """SHA-256 of the unit's bytes: its name in a worker's cache."""
        h = hashlib.sha256()
        for data in self.chunks():
            h.update(data)
        return h.hexdigest()

    def source_key(self) -> str:
        """What the unit's bytes are made of (file, offset, length and the file's size and
        modification time of every tensor): equal keys, equal digests, so rank 0 hashes a
        unit once per checkpoint (DigestCache)."""
        h = hashlib.sha256(f"{UNIT_FORMAT}".encode())
        h.update(self.header)
        for name, t in self.tensors:
            stat = os.stat(t.file)  # type: ignore[arg-type]
            h.update(
                f"{name}:{t.file}:{t.offset}:{t.nbytes}:{stat.st_size}:{stat.st_mtime_ns}".encode()
            )
        return h.hexdigest()


def compose_header(tensors: list[tuple[str, checkpoint.Tensor]]) -> bytes:
    """A safetensors header for `tensors` laid out in order, padded to 8 bytes as the
    format asks."""
    header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
    position = 0
    for name, t in tensors:
        header[name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [position, position + t.nbytes],
        }
        position += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def rank0_parts(config: dict[str, Any]) -> set[str]:
    """The names of the parts outside every layer only rank 0 holds: the embedding,
    final norm and LM head, and what the family computes on rank 0 alone (its root
    parts)."""
    adapter = adapter_of(config)
    parts = adapter.parts
    own = {parts.embed, parts.head_name, *adapter.root_parts}
    if parts.norm is not None:
        own.add(parts.norm)
    return own


def rank0_tensor(name: str, own: set[str]) -> bool:
    """Whether a tensor outside every layer is one only rank 0 holds: in one of its
    parts (`own`: rank0_parts), or a vision model's tower and projector."""
    return vision.encoder_tensor(name) or any(part in own for part in name.split("."))


def worker_units(path: Path, start: int, end: int) -> list[Unit]:
    """The units of a worker that runs layers [start, end) of the checkpoint at `path`:
    one per layer, then the tensors outside every layer a worker's stage holds (if any)."""
    config = sharding.read_config(path)
    second = sharding.second_list_from(config)
    own = rank0_parts(config)
    by_layer: dict[int, list[tuple[str, checkpoint.Tensor]]] = {}
    shared: list[tuple[str, checkpoint.Tensor]] = []
    for name, t in sorted(checkpoint.tensors(path).items()):
        layer = checkpoint.layer_of(name, second)
        if layer is None:
            if not rank0_tensor(name, own):
                shared.append((name, t))
        elif start <= layer < end:
            by_layer.setdefault(layer, []).append((name, t))
    units = [
        Unit(f"layer-{layer:05d}", tuple(by_layer[layer]), compose_header(by_layer[layer]))
        for layer in sorted(by_layer)
    ]
    if shared:
        units.append(Unit(GLOBAL_UNIT, tuple(shared), compose_header(shared)))
    return units


def build_view(root: Path, config_text: str, blobs: dict[str, Path]) -> Path:
    """A directory mlx-lm's loader reads as a model: `config_text` as config.json and a
    `model-<unit>.safetensors` link to each unit's file in the cache (`blobs`: unit name
    -> file). Named by its contents, so a launch with the same model and split finds it
    again; written whole or not at all."""
    h = hashlib.sha256(config_text.encode())
    for name in sorted(blobs):
        h.update(f"{name}:{blobs[name].name}".encode())
    view = root / "views" / h.hexdigest()[:24]
    if view.is_dir():
        return view
    scratch = view.with_name(view.name + f".tmp{os.getpid()}")
    scratch.mkdir(parents=True, exist_ok=True, mode=0o700)
    (scratch / "config.json").write_text(config_text)
    for name, blob in blobs.items():
        (scratch / f"model-{name}.safetensors").symlink_to(blob.resolve())
    try:
        scratch.rename(view)
    except OSError:  # (another rank of this machine made it first: the same contents)
        for f in scratch.iterdir():
            f.unlink()
        scratch.rmdir()
    return view
