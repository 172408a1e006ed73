"""What a checkpoint holds, from its safetensors headers alone: no weight is read.

The memory check and the split both weigh layers by their tensors' bytes, so both ask
here which layer a tensor belongs to.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from mlx_relay.model import vision

# A decoder layer's tensors: `...layers.N.` (nanochat's decoder: `transformer.h.N.`).
_LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")
# Layers kept in a second list after the first (afm7's `kv_reuse_layers.N.`): the
# model's layer (length of the first list) + N.
_SECOND_LIST = re.compile(r"(?:^|\.)kv_reuse_layers\.(\d+)\.")


@dataclass(frozen=True)
class Tensor:
    dtype: str  # as safetensors names it: "F16", "BF16", "U32" ...
    nbytes: int
    shape: tuple[int, ...] = ()
    file: Path | None = None  # the safetensors file that holds it
    offset: int = 0  # where its bytes start in that file


def tensors(path: Path) -> dict[str, Tensor]:
    """Every tensor in the checkpoint at `path`, by name, and where its bytes lie."""
    found: dict[str, Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                first, last = info["data_offsets"]
                shape = tuple(info.get("shape", ()))
                found[name] = Tensor(
                    info.get("dtype", ""), last - first, shape, f, 8 + size + first
                )
    return found


def tensor_bytes(path: Path) -> dict[str, int]:
    """Bytes of every tensor in the checkpoint at `path`, by name."""
    return {name: t.nbytes for name, t in tensors(path).items()}


def layer_of(name: str, second_list_from: int = 0) -> int | None:
    """The decoder layer tensor `name` belongs to; None for everything else: the
    embedding, final norm and LM head, and a VLM's vision tower and projector (whose own
    `layers.N` are not the language model's), all rank 0's. `second_list_from`: the
    model's index of the first layer of a second list (sharding.second_list_from)."""
    if vision.encoder_tensor(name):
        return None
    if second_list_from and (match := _SECOND_LIST.search(name)):
        return second_list_from + int(match.group(1))
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None
