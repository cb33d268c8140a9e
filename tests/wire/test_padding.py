"""Padded frames (wire/padding.py): exact ladder sizes, stripped on decode, the same size whatever the block's
rows, keep list or positions, and the reply padded like its step (threat T6)."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitinfer.errors import ProtocolError
from splitinfer.masks import BlockStructure
from splitinfer.wire.clientlink import Block, ClientLink
from splitinfer.wire.frame import decode_frame, encode_frame
from splitinfer.wire.messages import Limits, Result, Step, Welcome, decode_client_message, decode_server_message
from splitinfer.wire.padding import HEADER_ALLOWANCE, pad_frame, padded_size

D = 16
ROW = D * 2  # float16 bytes a row
LIMITS = Limits(hidden_size=D, dtypes=("float16",))


def test_the_ladder_is_the_allowance_plus_whole_quanta():
    assert padded_size(1, 100) == HEADER_ALLOWANCE + 100
    assert padded_size(HEADER_ALLOWANCE + 100, 100) == HEADER_ALLOWANCE + 100
    assert padded_size(HEADER_ALLOWANCE + 101, 100) == HEADER_ALLOWANCE + 200


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300), st.binary(max_size=700), st.integers(1, 600))
def test_a_padded_frame_has_its_ladder_size_and_decodes_to_the_same_message(text, body, quantum):
    frame = encode_frame({"type": "x", "text": text}, body)
    padded = pad_frame(frame, quantum)
    assert len(padded) == padded_size(len(frame) + 32, quantum)
    header, view = decode_frame(padded)
    assert header == {"type": "x", "text": text} and bytes(view) == body


def test_quantum_zero_leaves_the_frame_alone():
    frame = encode_frame({"type": "x"}, b"abc")
    assert pad_frame(frame, 0) is frame


def _bad(pad) -> bytes:
    raw = json.dumps({"type": "x", "pad": pad}).encode()
    return struct.pack(">I", len(raw)) + raw + b"\0" * 4


@pytest.mark.parametrize("pad", [-1, 5, 1.5, "4", True])
def test_a_pad_count_that_is_not_a_count_of_the_body_bytes_is_refused(pad):
    with pytest.raises(ProtocolError, match="pad"):
        decode_frame(_bad(pad))


def _step(rows: int, keep: tuple[int, ...], start: int, quantum: int) -> Step:
    parents = [-1] + [i - 1 for i in range(1, rows)]
    return Step(7, keep, tuple(range(start, start + rows)), BlockStructure.tree(parents),
                torch.randn(rows, D), "float16", pad_quantum=quantum)


def test_every_block_up_to_the_padding_rows_has_one_size_and_its_reply_too():
    quantum = 33 * ROW
    steps = [_step(q, keep, start, quantum) for q in (1, 2, 9, 33) for keep in ((), (0,), (0, 2, 5, 7))
             for start in (5, 123_456)]
    sizes = {len(s.encode()) for s in steps}
    assert sizes == {HEADER_ALLOWANCE + quantum}
    unpadded = {len(_step(q, (), 5, 0).encode()) for q in (1, 2, 9, 33)}
    assert len(unpadded) == 4  # what padding hides: without it the size tells the rows
    replies = set()
    for s in steps:
        got = decode_client_message(s.encode(), LIMITS)
        assert got.pad_quantum == quantum and got.keep == s.keep and got.positions == s.positions
        assert torch.equal(got.hidden, s.hidden.to(torch.float16))
        reply = Result(s.seq, got.hidden, 1.23456 * s.hidden.shape[0], 2.5, 1000 + len(s.keep), "float16",
                       pad_quantum=got.pad_quantum).encode()
        replies.add(len(reply))
        back = decode_server_message(reply, LIMITS)
        assert torch.equal(back.hidden, got.hidden) and back.committed == 1000 + len(s.keep)
    skipped = Result(7, torch.empty(0, D), 0.0, 0.1, 3, skipped=True, pad_quantum=quantum).encode()
    assert replies == {len(skipped)} == {HEADER_ALLOWANCE + quantum}
    assert decode_server_message(skipped, LIMITS).skipped


def test_an_unpadded_step_is_the_v1_step_byte_for_byte():
    step = _step(3, (0, 1), 10, 0)
    assert b"pad" not in step.encode()
    assert decode_client_message(step.encode(), LIMITS).pad_quantum == 0


def test_the_client_link_asks_for_pad_rows_of_its_wire_dtype():
    link = ClientLink("float16", pad_rows=33)
    link.submit(Block((0, 1), BlockStructure.chain(), torch.randn(2, D)))
    assert link.next_send().resume_id is None  # the hello first
    link.on_welcome(Welcome("s", 0, False, 1 << 26, 1024))
    step = link.next_send()
    assert step.pad_quantum == 33 * ROW and len(step.encode()) == HEADER_ALLOWANCE + 33 * ROW


def test_a_step_may_not_ask_for_a_reply_padded_past_its_own_size():
    """An unpadded step asking for a 16 MiB reply quantum would turn a few hundred bytes into megabytes sent:
    the decoder bounds reply_pad by the step's own message size (a padded step always satisfies it)."""
    raw = _step(1, (), 5, 0).encode()
    (length,) = struct.unpack(">I", raw[:4])
    header = json.loads(raw[4 : 4 + length])
    header["reply_pad"] = 1 << 20
    with pytest.raises(ProtocolError, match="reply_pad"):
        decode_client_message(encode_frame(header, raw[4 + length :]), LIMITS)
    padded = _step(1, (), 5, 33 * ROW).encode()
    assert decode_client_message(padded, LIMITS).pad_quantum == 33 * ROW


def test_a_padding_setting_is_parsed_from_its_name_and_gives_it_back():
    from splitinfer.wire.padding import PadSetting

    for name, setting in [("0", PadSetting()), ("33", PadSetting(33)), ("33+s64", PadSetting(33, 64)),
                          ("33+s64+h110+t50", PadSetting(33, 64, 110, 50)), ("8+t5", PadSetting(8, think_ms=5))]:
        assert PadSetting.parse(name) == setting and setting.key == name
    assert PadSetting(33, 64, 110, 50).client_fields() == {"pad_rows": 33, "pad_steps": 64, "pad_hold_ms": 110,
                                                          "pad_think_ms": 50}
    for bad in ("", "x", "33+", "33+z1", "0+s64", "-1"):
        with pytest.raises(ValueError):
            PadSetting.parse(bad)
