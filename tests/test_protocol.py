"""The wire formats: step header and signed side-channel messages."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_relay.protocol import control
from mlx_relay.protocol import header as hdr


def test_header_round_trip_with_several_sequences():
    h = hdr.StepHeader(
        cmd=hdr.CMD_FORWARD,
        step_id=12345,
        flags=hdr.FLAG_WANT_OUTPUT,
        payload_kind=hdr.PAYLOAD_HIDDEN,
        payload_dtype="bfloat16",
        payload_shape=(3, 7, 576),
        group=2,
        slots=[0, 5, 15],
        offsets=[0, 100, 8191],
        lengths=[7, 1, 1],
    )
    raw = hdr.encode(h)
    assert raw.dtype == np.int32 and raw.shape == (hdr.HEADER_LEN,)
    assert hdr.decode(raw) == h
    assert hdr.payload_nbytes_shape(h) == (3, 7, 576)


def test_the_return_hop_carries_each_rows_last_position_at_the_last_ranks_width():
    """Rank 0 posts the return's receive when it launches a step: one position a row,
    all of it only when it wants the output, at the width the last layer leaves (Kimi
    K3's layers widen the state: rank 0 says how wide)."""
    sent = hdr.StepHeader(
        cmd=hdr.CMD_FORWARD,
        flags=hdr.FLAG_WANT_OUTPUT,
        payload_kind=hdr.PAYLOAD_HIDDEN,
        payload_dtype="float32",
        payload_shape=(2, 9, 128),
        slots=[0, 1],
        offsets=[0, 0],
        lengths=[9, 9],
    )
    assert hdr.returned(sent).payload_shape == (2, 1, 128)
    assert hdr.returned(sent, 256).payload_shape == (2, 1, 256)
    sent.flags = 0  # (a prefill chunk: its first value only says it was computed)
    assert hdr.returned(sent, 256).payload_shape == (2, 1, 1)
    assert sent.payload_shape == (2, 9, 128)  # (a copy: what was sent is kept)


def test_error_flags_keep_the_first_failure_code():
    h = hdr.StepHeader(cmd=hdr.CMD_PING)
    h.mark_failed(2, hdr.ERR_OUT_OF_MEMORY)
    h.mark_failed(1, hdr.ERR_EXCEPTION)
    back = hdr.decode(hdr.encode(h))
    assert back.failed_ranks == [1, 2]
    assert back.error_code == hdr.ERR_OUT_OF_MEMORY


def test_headers_from_another_version_or_garbage_are_refused():
    raw = hdr.encode(hdr.StepHeader(cmd=hdr.CMD_PING))
    raw[0] ^= 0xFF
    with pytest.raises(hdr.ProtocolError, match="different mlx-relay versions"):
        hdr.decode(raw)
    with pytest.raises(hdr.ProtocolError):
        hdr.decode(np.zeros(3, dtype=np.int32))
    too_many = hdr.StepHeader(cmd=hdr.CMD_FREE, slots=list(range(hdr.MAX_SEQS + 1)))
    too_many.offsets = too_many.lengths = [0] * too_many.n_seqs
    with pytest.raises(hdr.ProtocolError):
        hdr.encode(too_many)


def test_side_channel_messages_are_signed():
    frames = control.encode(control.HELLO, {"rank": 1}, b"secret")
    assert control.decode(frames, b"secret") == {"kind": "hello", "rank": 1}
    with pytest.raises(control.BadMessage, match="signature"):
        control.decode(frames, b"other secret")
    with pytest.raises(control.BadMessage):
        control.decode([frames[0]], b"secret")
