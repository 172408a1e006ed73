"""Step inputs besides the hidden state: the header's side arrays and deltas, and how a
stage slices them (no model needed; Qwen2-VL's use of them is in test_vision_qwen2_vl)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_relay.model.step_inputs import LayerInputs, PromptInputs
from mlx_relay.protocol import header as hdr
from mlx_relay.transport.ring import EAGER, READY, Ring, zip_sides


def _forward(**fields) -> hdr.StepHeader:
    return hdr.StepHeader(
        cmd=hdr.CMD_FORWARD,
        step_id=7,
        payload_kind=hdr.PAYLOAD_HIDDEN,
        payload_dtype="bfloat16",
        payload_shape=(2, 5, 64),
        slots=[3, 9],
        offsets=[0, 40],
        lengths=[5, 2],
        **fields,
    )


def test_side_arrays_and_deltas_round_trip():
    """Every side array's kind, dtype and shape (any rank up to 4) travel in the header,
    so an eager rank can post each receive before any data arrives."""
    h = _forward(
        sides=[
            hdr.SideArray(hdr.SIDE_POSITIONS, "int32", (3, 2, 5)),
            hdr.SideArray(hdr.SIDE_PER_LAYER, "float16", (2, 5, 35, 256)),
        ],
        deltas=[-12, 0],
    )
    raw = hdr.encode(h)
    assert raw.shape == (hdr.HEADER_LEN,)
    assert hdr.decode(raw) == h


def test_a_step_without_side_inputs_has_none():
    """Most models' steps: no side array, and all-zero deltas read back as none."""
    h = _forward(deltas=[0, 0])
    back = hdr.decode(hdr.encode(h))
    assert back.sides == [] and back.deltas == []


def test_the_last_rank_returns_no_side_arrays():
    h = _forward(sides=[hdr.SideArray(hdr.SIDE_POSITIONS, "int32", (3, 2, 5))], deltas=[4, 1])
    back = hdr.returned(h)
    assert back.sides == [] and back.deltas == [4, 1]
    assert back.payload_shape == (2, 1, 1)
    assert h.sides  # (the sender's copy keeps them)


def test_side_arrays_a_header_cannot_describe_are_refused():
    side = hdr.SideArray(hdr.SIDE_POSITIONS, "int32", (3, 2, 5))
    with pytest.raises(hdr.ProtocolError, match="at most"):
        hdr.encode(_forward(sides=[side] * (hdr.MAX_SIDE + 1)))
    with pytest.raises(hdr.ProtocolError, match="cannot be described"):
        hdr.encode(_forward(sides=[hdr.SideArray(hdr.SIDE_POSITIONS, "int32", (1,) * 5)]))
    with pytest.raises(hdr.ProtocolError, match="cannot be described"):
        hdr.encode(_forward(sides=[hdr.SideArray(99, "int32", (3,))]))
    with pytest.raises(hdr.ProtocolError, match="one entry per sequence"):
        hdr.encode(_forward(deltas=[1]))
    raw = hdr.encode(_forward(sides=[side]))
    for at, value in ((hdr._SIDES, 0), (hdr._N_SIDE, hdr.MAX_SIDE + 1)):  # garbage
        bad = raw.copy()
        bad[at] = value
        with pytest.raises(hdr.ProtocolError, match="side array"):
            hdr.decode(bad)
    with pytest.raises(hdr.ProtocolError, match="lists 1 side arrays, 0 given"):
        zip_sides(_forward(sides=[side]), [])


def test_layer_inputs_follow_the_rows_and_tokens_of_a_step():
    """A stage runs each prefill sequence alone on its first `length` tokens, and a
    row-by-row decode group one row at a time: their positions are sliced to match."""
    positions = mx.arange(3 * 2 * 5).reshape(3, 2, 5)
    h = _forward(deltas=[-3, 2])
    second = LayerInputs.of_step(h, {hdr.SIDE_POSITIONS: positions}, slice(1, 2), 2)
    assert second.offsets == [40] and second.deltas == [2]
    assert second.positions.tolist() == positions[:, 1:2, :2].tolist()
    group = LayerInputs.of_step(_forward(), {}, slice(None), 1)
    assert group.deltas == [0, 0] and group.positions is None
    assert group.row(1).offsets == [40]


def test_a_prompt_chunk_takes_its_share_of_positions():
    prompt = PromptInputs(mx.zeros((1, 10, 4)), mx.arange(30).reshape(3, 1, 10), delta=-5)
    part = prompt.chunk(6, 4)
    assert part.embeddings.shape == (1, 4, 4) and part.delta == -5
    assert part.positions.tolist() == [[[6, 7, 8, 9]], [[16, 17, 18, 19]], [[26, 27, 28, 29]]]


class _Bell:
    def __init__(self) -> None:
        self.rung: list[bytes] = []

    def ring(self, message: bytes) -> None:
        self.rung.append(message)


class _Group:
    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 2


@pytest.mark.parametrize("mode", [EAGER, READY])
def test_a_side_array_that_differs_from_its_announcement_never_leaves(mode):
    """Checked before the header goes: a next rank never waits for half a step."""
    bell = _Bell()
    ring = Ring(_Group(), bell, mode)  # (nothing reaches the group: refused first)
    header = _forward(sides=[hdr.SideArray(hdr.SIDE_PER_LAYER, "bfloat16", (2, 5, 4, 2))])
    payload = mx.zeros((2, 5, 64), mx.bfloat16)
    with pytest.raises(hdr.ProtocolError, match="announces a side array"):
        ring.send(header, payload, [mx.zeros((2, 5, 4, 2), mx.float32)])
    with pytest.raises(hdr.ProtocolError, match="announces a payload"):
        ring.send(header, mx.zeros((2, 5, 32), mx.bfloat16), [])
    assert bell.rung == []
