"""The step header: the one fixed-size message every rank receives before it acts.

Every collective a rank issues is derived from the header alone, so rank 0 and the
workers can never disagree about what comes next on the ring. The header travels
0 -> 1 -> ... -> N-1 -> 0 ahead of its payload; when it returns to rank 0 it is also
the acknowledgement that every rank did the step, with any error flags they set.

Layout (int32, HEADER_LEN entries):

    0  MAGIC            protocol version check: a stranger's bytes are refused
    1  cmd              CMD_* code
    2  step_id          increasing per step, for logs and matching errors
    3  flags            FLAG_* bits
    4  error_mask       bit r set: rank r failed in this step
    5  error_code       ERR_* of the first rank that failed
    6  payload_kind     PAYLOAD_NONE / PAYLOAD_HIDDEN / PAYLOAD_BYTES
    7  payload_dtype    index into DTYPES
    8..10              payload shape (batch, tokens, hidden) or (nbytes, 0, 0)
    11 n_seqs           sequences in this step (<= MAX_SEQS)
    12 group            NO_GROUP: each sequence runs alone on its own cache (prefill);
                        else the id of a decode group: the sequences run as one batch
    13..               slots[MAX_SEQS], offsets[MAX_SEQS], lengths[MAX_SEQS]
    61 source           with FLAG_REUSE: the slot whose kept cache the step's one sequence
                        starts from (its own slot: cut back in place; another: copied)
    62 n_side           side arrays that follow the payload on the ring (<= MAX_SIDE)
    63..               MAX_SIDE x (kind, dtype, ndim, d0, d1, d2, d3): each side array
    77..               deltas[MAX_SEQS]: each sequence's position delta (below)

*Side arrays* are a forward step's inputs besides the hidden state that only rank 0 can
compute (a multimodal-rope model's 3-D position ids, which come from the image grid;
gemma4's per-layer inputs, from a table only rank 0 holds): they follow the payload in
the header's order, every rank receives them (their shapes are in the header, so an
eager rank posts every receive at once) and forwards what the ranks after it need,
rewriting their entries in the header it forwards (positions unchanged; per-layer
inputs less its own layers' slices: model/step_inputs.pass_on); the last rank sends none
back. A step of a model that needs none has none: nothing extra travels. A *delta* shifts a sequence's positions: its token j sits at
position offset + j + delta where no side array gives positions (a multimodal-rope
model decodes at offset + rope_delta, one delta per sequence fixed at its prefill);
zero for every other model, and it costs nothing, as the header travels anyway.

A sequence *slot* names a KV cache on every rank; *offset* is the position of the
sequence's first token in this step (0 starts a fresh cache), *length* the number of
new tokens it contributes. A decode group's batch cache holds exactly the slots its
latest step listed, in that order: every rank rebuilds it the same way when the list
changes (kvcache.SlotCaches), so membership needs no message of its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

# 4: side arrays and deltas; 5: laps, widths that change on the way; 6: token types;
# 8: CMD_PROBE; 9: FLAG_ALL_POSITIONS; 10: CMD_TIME_ALL_SUM; 11: CMD_STAGE;
# 12: CMD_STORE, CMD_RESTORE
PROTOCOL_VERSION = 12
MAGIC = 0x4D4C5200 | PROTOCOL_VERSION  # "MLR" + version

MAX_SEQS = 16
MAX_RANKS = 31  # error_mask is an int32 bitmask

# Commands. Every one is acknowledged by the header coming back to rank 0.
CMD_FORWARD = 1  # run layers for the announced sequences
CMD_LOAD = 2  # payload: JSON load spec (model path, layer ranges)
CMD_UNLOAD = 3  # drop model and caches, keep running
CMD_FREE = 4  # free the KV caches of the announced slots
CMD_SHUTDOWN = 6  # release everything and leave the loop: the last step a worker takes
CMD_PING = 7  # no-op round trip (tests, health)
CMD_PROBE = 8  # each worker measures its speed and writes it into `lengths` at its rank
# FLAG_TENSOR: the tensor group times all-sums of the payload fields' shape and dtype, every
# rank at once (--tensor-parallel auto; transport/tensor.py's time_all_sum)
CMD_TIME_ALL_SUM = 9
# payload: JSON staging document (--stage-weights): each worker starts fetching its shard's
# files from rank 0 in the background and passes the step on at once (worker/staging.py).
CMD_STAGE = 10
# --prompt-cache-dir (model/prefix_store.py), payload a JSON document, the step's one slot:
# STORE writes the listed blocks ({"blocks": [[index, key], ...]}) of the parked slot's
# caches to each rank's disk; RESTORE loads blocks ({"keys": [...]}) into the slot as one
# sequence's caches (a rank that cannot fails the step, and rank 0 prefills instead).
CMD_STORE = 11
CMD_RESTORE = 12

COMMAND_NAMES = {
    CMD_FORWARD: "FORWARD",
    CMD_LOAD: "LOAD",
    CMD_UNLOAD: "UNLOAD",
    CMD_FREE: "FREE",
    CMD_SHUTDOWN: "SHUTDOWN",
    CMD_PING: "PING",
    CMD_PROBE: "PROBE",
    CMD_TIME_ALL_SUM: "TIME_ALL_SUM",
    CMD_STAGE: "STAGE",
    CMD_STORE: "STORE",
    CMD_RESTORE: "RESTORE",
}

# Flags.
# The last rank sends back each row's last hidden state (else the header only).
FLAG_WANT_OUTPUT = 1 << 0
# CMD_FREE: keep the slots' caches, each as a single sequence's, for a later prefix reuse.
FLAG_PARK = 1 << 1
# CMD_FORWARD of one sequence: start from slot `source`'s kept cache, cut back to the
# step's offset (source == the slot: in place; another slot: a copy, the source stays).
FLAG_REUSE = 1 << 2
# CMD_FORWARD of a model whose steps run its layers twice (IQuest Loop Coder): the first
# lap, whose last rank sends every position back (rank 0 starts the second lap on them),
# and the second lap, which runs each rank's layers again on the caches the first left.
FLAG_FIRST_LAP = 1 << 3
FLAG_SECOND_LAP = 1 << 4
# A hop of the step whose payloads (and side arrays) travel as an all-sum of the pair
# (transport/collective.py), not over the ring: the hop out of rank 0, and the hop back
# to it. Rank 0 decides per step (a cluster of 2 ranks has no other hops).
FLAG_COLLECTIVE_OUT = 1 << 5
FLAG_COLLECTIVE_BACK = 1 << 6
FLAGS_COLLECTIVE = FLAG_COLLECTIVE_OUT | FLAG_COLLECTIVE_BACK
# This hop's payload follows the header in the doorbell's message, not over the ring
# (READY hops, small payloads: transport/ring.py). Set or cleared by each sender.
FLAG_INLINE = 1 << 7
# The hop back to rank 0 carries its payload inline, sent by the last rank once computed
# (ADAPTIVE hops, a step launched beside others: transport/ring.py). Rank 0 decides.
FLAG_INLINE_BACK = 1 << 8
# The last rank sends back every position of the step, not only each row's last: a
# speculative verify step, whose k+1 positions each give logits (rank 0 samples them all).
FLAG_ALL_POSITIONS = 1 << 9
# A tensor-parallel step: every rank runs the same layers, each its slice of every
# layer (transport/tensor.py). The header goes round the ring alone, as the step's
# announcement and, back at rank 0, its acknowledgement; the hidden state enters the
# layers by an all-sum of the tensor group, whose shape and dtype the payload fields
# give (payload_kind stays PAYLOAD_NONE: nothing travels on the ring).
FLAG_TENSOR = 1 << 10
# With FLAG_TENSOR, CMD_TIME_ALL_SUM times each rank's pair (auto's grid of pairs,
# transport/tensor.py) instead of the whole group, one pair after another: a pair's
# second rank writes its figure (microseconds) into `lengths` at its rank, then sends the
# header on (the header announces a slot a rank, as CMD_PROBE's does).
FLAG_PAIRS = 1 << 11

# Payload kinds.
PAYLOAD_NONE = 0
PAYLOAD_HIDDEN = 1  # float array (batch, tokens, hidden)
PAYLOAD_BYTES = 2  # uint8 array (nbytes,), e.g. a JSON document

DTYPES = ("float32", "float16", "bfloat16", "uint8", "int32")

# Side array kinds (see above).
SIDE_POSITIONS = 1  # int32 (3, rows, tokens): multimodal rope positions (t, h, w) per token
SIDE_PER_LAYER = 2  # float (rows, tokens, layers, dim): inputs each layer gets besides h
SIDE_TOKEN_TYPES = 3  # int32 (rows, tokens): 1 at an image's tokens (gemma4's image mask)
SIDE_KINDS = {
    SIDE_POSITIONS: "positions",
    SIDE_PER_LAYER: "per-layer inputs",
    SIDE_TOKEN_TYPES: "token types",
}
MAX_SIDE = 2
SIDE_DIMS = 4
_SIDE_ENTRY = 3 + SIDE_DIMS  # kind, dtype, ndim, shape

# Error codes (a worker sets the first one it meets; details go over the side channel).
ERR_NONE = 0
ERR_EXCEPTION = 1
ERR_NO_MODEL = 2
ERR_LOAD = 3
ERR_BAD_HEADER = 4
ERR_OUT_OF_MEMORY = 5

ERROR_NAMES = {
    ERR_NONE: "none",
    ERR_EXCEPTION: "exception",
    ERR_NO_MODEL: "no model loaded",
    ERR_LOAD: "load failed",
    ERR_BAD_HEADER: "bad header",
    ERR_OUT_OF_MEMORY: "out of memory",
}

NO_GROUP = -1

_GROUP = 12
_SLOTS = 13
_OFFSETS = _SLOTS + MAX_SEQS
_LENGTHS = _OFFSETS + MAX_SEQS
_SOURCE = _LENGTHS + MAX_SEQS
_N_SIDE = _SOURCE + 1
_SIDES = _N_SIDE + 1
_DELTAS = _SIDES + MAX_SIDE * _SIDE_ENTRY
HEADER_LEN = _DELTAS + MAX_SEQS
NO_SOURCE = -1


class ProtocolError(ValueError):
    """A header that no rank of this version could have sent."""


@dataclass(frozen=True)
class SideArray:
    """What the header says of one side array: its kind, dtype and shape."""

    kind: int
    dtype: str
    shape: tuple[int, ...]


@dataclass
class StepHeader:
    cmd: int
    step_id: int = 0
    flags: int = 0
    error_mask: int = 0
    error_code: int = ERR_NONE
    payload_kind: int = PAYLOAD_NONE
    payload_dtype: str = "float32"
    payload_shape: tuple[int, int, int] = (0, 0, 0)
    group: int = NO_GROUP
    slots: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    source: int = NO_SOURCE
    sides: list[SideArray] = field(default_factory=list)
    deltas: list[int] = field(default_factory=list)  # empty: all zero

    @property
    def n_seqs(self) -> int:
        return len(self.slots)

    @property
    def failed_ranks(self) -> list[int]:
        return [r for r in range(MAX_RANKS) if self.error_mask >> r & 1]

    def mark_failed(self, rank: int, code: int) -> None:
        """Record a failure without hiding an earlier rank's error code."""
        if self.error_mask == 0:
            self.error_code = code
        self.error_mask |= 1 << rank

    def describe(self) -> str:
        name = COMMAND_NAMES.get(self.cmd, str(self.cmd))
        return f"step {self.step_id} {name} slots={self.slots}"


def payload_nbytes_shape(header: StepHeader) -> tuple[int, ...]:
    """The shape of the payload the header announces (empty tuple for none)."""
    if header.payload_kind == PAYLOAD_NONE:
        return ()
    if header.payload_kind == PAYLOAD_BYTES:
        return (header.payload_shape[0],)
    return tuple(header.payload_shape)


def set_returned_payload(header: StepHeader, width: int | None = None) -> None:
    """Make `header` announce what the last rank sends back to rank 0 for it.

    A forward step returns each row's last position: all of it (what the LM head needs)
    when rank 0 asked for output, else its first value only, which tells rank 0 that
    every rank has computed the step (a prefill chunk is timed by it, and no more steps
    are in flight than the engine allows). A command returns nothing. Rank 0 knows this
    when it launches a step, so it can post the receive at once. Each rank announces
    the width of what it sends on (a family's layers may widen the state: Kimi K3's
    attention residuals); `width`: the last rank's, where rank 0 has announced its own.
    A first lap (FLAG_FIRST_LAP) and a verify step (FLAG_ALL_POSITIONS) return every
    position whole.
    """
    header.sides = []  # the last rank sends no side arrays back
    if header.cmd == CMD_FORWARD and header.payload_kind == PAYLOAD_HIDDEN:
        rows, tokens, hidden = header.payload_shape
        hidden = hidden if width is None else width
        if header.flags & (FLAG_FIRST_LAP | FLAG_ALL_POSITIONS):
            header.payload_shape = (rows, tokens, hidden)
        else:
            header.payload_shape = (rows, 1, hidden if header.flags & FLAG_WANT_OUTPUT else 1)
    else:
        header.payload_kind = PAYLOAD_NONE
        header.payload_shape = (0, 0, 0)


def returned(header: StepHeader, width: int | None = None) -> StepHeader:
    """A copy of `header` as the last rank sends it back (see set_returned_payload)."""
    back = dataclasses.replace(header)
    set_returned_payload(back, width)
    return back


def encode(header: StepHeader) -> np.ndarray:
    n = header.n_seqs
    if n > MAX_SEQS:
        raise ProtocolError(f"{n} sequences in one step, at most {MAX_SEQS}")
    if not (len(header.offsets) == len(header.lengths) == n):
        raise ProtocolError("slots, offsets and lengths must have the same length")
    out = np.zeros(HEADER_LEN, dtype=np.int32)
    out[0] = MAGIC
    out[1] = header.cmd
    out[2] = header.step_id
    out[3] = header.flags
    out[4] = header.error_mask
    out[5] = header.error_code
    out[6] = header.payload_kind
    out[7] = DTYPES.index(header.payload_dtype)
    out[8:11] = header.payload_shape
    out[11] = n
    out[_GROUP] = header.group
    out[_SLOTS : _SLOTS + n] = header.slots
    out[_OFFSETS : _OFFSETS + n] = header.offsets
    out[_LENGTHS : _LENGTHS + n] = header.lengths
    out[_SOURCE] = header.source
    if len(header.sides) > MAX_SIDE:
        raise ProtocolError(f"{len(header.sides)} side arrays in one step, at most {MAX_SIDE}")
    out[_N_SIDE] = len(header.sides)
    for i, side in enumerate(header.sides):
        if not 1 <= len(side.shape) <= SIDE_DIMS or side.kind not in SIDE_KINDS:
            raise ProtocolError(f"side array {side} cannot be described in a header")
        at = _SIDES + i * _SIDE_ENTRY
        out[at : at + 3] = (side.kind, DTYPES.index(side.dtype), len(side.shape))
        out[at + 3 : at + 3 + len(side.shape)] = side.shape
    if header.deltas and len(header.deltas) != n:
        raise ProtocolError("deltas, when given, must have one entry per sequence")
    out[_DELTAS : _DELTAS + len(header.deltas)] = header.deltas
    return out


def _decode_sides(raw: np.ndarray) -> list[SideArray]:
    count = int(raw[_N_SIDE])
    if not 0 <= count <= MAX_SIDE:
        raise ProtocolError(f"header announces {count} side arrays")
    sides = []
    for i in range(count):
        at = _SIDES + i * _SIDE_ENTRY
        kind, dtype, ndim = (int(x) for x in raw[at : at + 3])
        if kind not in SIDE_KINDS or not 0 <= dtype < len(DTYPES) or not 1 <= ndim <= SIDE_DIMS:
            raise ProtocolError(f"side array {i}: kind {kind}, dtype {dtype}, ndim {ndim}")
        shape = tuple(int(x) for x in raw[at + 3 : at + 3 + ndim])
        sides.append(SideArray(kind, DTYPES[dtype], shape))
    return sides


def decode(raw: np.ndarray) -> StepHeader:
    raw = np.asarray(raw, dtype=np.int32).reshape(-1)
    if raw.shape[0] != HEADER_LEN:
        raise ProtocolError(f"header has {raw.shape[0]} entries, expected {HEADER_LEN}")
    if int(raw[0]) != MAGIC:
        raise ProtocolError(
            f"header magic {int(raw[0]):#x} != {MAGIC:#x}: ranks run different mlx-relay versions"
        )
    n = int(raw[11])
    if not 0 <= n <= MAX_SEQS:
        raise ProtocolError(f"header announces {n} sequences")
    dtype_index = int(raw[7])
    if not 0 <= dtype_index < len(DTYPES):
        raise ProtocolError(f"unknown payload dtype {dtype_index}")
    return StepHeader(
        cmd=int(raw[1]),
        step_id=int(raw[2]),
        flags=int(raw[3]),
        error_mask=int(raw[4]),
        error_code=int(raw[5]),
        payload_kind=int(raw[6]),
        payload_dtype=DTYPES[dtype_index],
        payload_shape=(int(raw[8]), int(raw[9]), int(raw[10])),
        group=int(raw[_GROUP]),
        slots=[int(x) for x in raw[_SLOTS : _SLOTS + n]],
        offsets=[int(x) for x in raw[_OFFSETS : _OFFSETS + n]],
        lengths=[int(x) for x in raw[_LENGTHS : _LENGTHS + n]],
        source=int(raw[_SOURCE]),
        sides=_decode_sides(raw),
        deltas=[int(x) for x in deltas] if any(deltas := raw[_DELTAS : _DELTAS + n]) else [],
    )
