"""The wire codec: golden bytes, framing and tensor validation, field validation, and fuzzing.

Golden literals are written out by hand from the format
`[4-byte big-endian header length][compact JSON header][raw little-endian tensor bytes]`, so a change to
key order, separators, rounding or byte order fails here rather than between two releases of a peer.
"""

from __future__ import annotations

import copy
import json
import os
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitinfer.errors import MessageTooLarge, ProtocolError, SplitInferError
from splitinfer.masks import STRUCTURE_KINDS, BlockStructure
from splitinfer.wire.frame import (
    MAX_HEADER_BYTES,
    WIRE_DTYPES,
    decode_frame,
    decode_tensor,
    encode_frame,
    encode_tensor,
)
from splitinfer.wire.messages import (
    MAX_POSITION,
    Close,
    Error,
    Hello,
    Limits,
    Result,
    Step,
    Welcome,
    decode_client_message,
    decode_server_message,
)

# SPLITINFER_FUZZ_EXAMPLES raises the count for a longer campaign (see docs/security.md).
FUZZ = settings(
    max_examples=int(os.environ.get("SPLITINFER_FUZZ_EXAMPLES", "250")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# --------------------------------------------------------------------------------------------------
# Golden bytes
# --------------------------------------------------------------------------------------------------

# Hello header: 110 bytes = 0x6e.
HELLO = Hello(fingerprint="abc", cloud_layers=(2, 5), wire_dtype="float16")
HELLO_BYTES = (
    b"\x00\x00\x00\x6e"
    b'{"type":"hello","version":1,"fingerprint":"abc","cloud_layers":[2,5],"wire_dtype":"float16","session_id":null}'
)

# Welcome header: 140 bytes = 0x8c. Key order is the encoder's, not alphabetical.
WELCOME = Welcome(
    session_id="s-1", committed=12, resumed=True, max_message_bytes=1048576, max_block_rows=64, next_seq=3
)
WELCOME_BYTES = (
    b"\x00\x00\x00\x8c"
    b'{"type":"welcome","next_seq":3,"version":1,"session_id":"s-1","committed":12,"resumed":true,'
    b'"max_message_bytes":1048576,"max_block_rows":64}'
)

# float16: 1.0 = 0x3c00, -2.0 = 0xc000, 0.5 = 0x3800, 65504 (the largest finite half) = 0x7bff; little-endian.
STEP_HIDDEN = torch.tensor([[1.0, -2.0], [0.5, 65504.0]], dtype=torch.float32)
STEP = Step(
    seq=3,
    keep=(0, 2),
    positions=(5, 6),
    structure=BlockStructure.tree([-1, 0]),
    hidden=STEP_HIDDEN,
    wire_dtype="float16",
)
STEP_BYTES = (
    b"\x00\x00\x00\x96"  # 150
    b'{"type":"step","seq":3,"keep":[[0,1],[2,1]],"positions":[5,6],"structure":{"kind":"tree","parents":[-1,0]},'
    b'"tensor":{"dtype":"float16","shape":[2,2]}}'
    b"\x00\x3c\x00\xc0\x00\x38\xff\x7b"
)

# float32 with a matrix structure [[1,0],[1,1]]: bits 1011 padded -> 0xb0.
# float32: 1.0 = 0x3f800000, -2.5 = 0xc0200000; little-endian.
STEP_F32 = Step(
    seq=0,
    keep=(),
    positions=(0, 1),
    structure=BlockStructure.matrix(np.array([[True, False], [True, True]])),
    hidden=torch.tensor([[1.0], [-2.5]]),
    wire_dtype="float32",
)
STEP_F32_BYTES = (
    b"\x00\x00\x00\x88"  # 136
    b'{"type":"step","seq":0,"keep":[],"positions":[0,1],"structure":{"kind":"matrix","bits":"b0"},'
    b'"tensor":{"dtype":"float32","shape":[2,1]}}'
    b"\x00\x00\x80\x3f\x00\x00\x20\xc0"
)

# bfloat16 is the top half of float32: 1.0 = 0x3f80, -0.5 = 0xbf00, 3.0 = 0x4040, 65536 = 0x4780 (beyond
# float16's range, which is why the bfloat16 wire exists). compute_ms is rounded to 4 decimals on the wire.
RESULT_HIDDEN = torch.tensor([[1.0, -0.5], [3.0, 65536.0]], dtype=torch.float32)
RESULT = Result(seq=7, hidden=RESULT_HIDDEN, compute_ms=1.23456, handle_ms=2.5, committed=10, wire_dtype="bfloat16")
RESULT_BYTES = (
    b"\x00\x00\x00\x78"  # 120
    b'{"type":"result","seq":7,"compute_ms":1.2346,"handle_ms":2.5,"committed":10,'
    b'"tensor":{"dtype":"bfloat16","shape":[2,2]}}'
    b"\x80\x3f\x00\xbf\x40\x40\x80\x47"
)

ERROR = Error("session", "Session expired; reconnect.", seq=4)
ERROR_BYTES = b'\x00\x00\x00\x51{"type":"error","code":"session","message":"Session expired; reconnect.","seq":4}'  # 81

ERROR_NO_SEQ = Error("capacity", "Busy.")
ERROR_NO_SEQ_BYTES = b'\x00\x00\x00\x3f{"type":"error","code":"capacity","message":"Busy.","seq":null}'  # 63

CLOSE_BYTES = b'\x00\x00\x00\x10{"type":"close"}'  # 16

LIMITS = Limits(hidden_size=2, max_block_rows=64)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern of a tensor, so -0.0 and 0.0 (or two NaNs) are told apart."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize(
    "message, expected",
    [
        (HELLO, HELLO_BYTES),
        (WELCOME, WELCOME_BYTES),
        (STEP, STEP_BYTES),
        (STEP_F32, STEP_F32_BYTES),
        (RESULT, RESULT_BYTES),
        (ERROR, ERROR_BYTES),
        (ERROR_NO_SEQ, ERROR_NO_SEQ_BYTES),
        (Close(), CLOSE_BYTES),
    ],
    ids=["hello", "welcome", "step-f16", "step-f32", "result-bf16", "error", "error-no-seq", "close"],
)
def test_encode_matches_golden_bytes(message, expected):
    assert message.encode() == expected
    (length,) = struct.unpack(">I", expected[:4])
    json.loads(expected[4 : 4 + length])  # the literal itself is consistent: its prefix covers exactly the JSON


def test_golden_hello_decodes():
    assert decode_client_message(HELLO_BYTES, LIMITS) == HELLO


def test_golden_hello_with_session_decodes():
    hello = Hello(fingerprint="abc", cloud_layers=(0, 30), wire_dtype="bfloat16", session_id="s-1")
    decoded = decode_client_message(hello.encode(), LIMITS)
    assert decoded == hello and decoded.session_id == "s-1"


def test_golden_welcome_decodes():
    assert decode_server_message(WELCOME_BYTES, LIMITS) == WELCOME


def test_golden_step_decodes():
    step = decode_client_message(STEP_BYTES, LIMITS)
    assert isinstance(step, Step)
    assert (step.seq, step.keep, step.positions, step.wire_dtype) == (3, (0, 2), (5, 6), "float16")
    assert step.structure == BlockStructure.tree([-1, 0])
    assert step.hidden.dtype == torch.float16 and step.hidden.shape == (2, 2)
    assert torch.equal(step.hidden, STEP_HIDDEN.to(torch.float16))
    assert step.hidden.tolist() == [[1.0, -2.0], [0.5, 65504.0]]


def test_golden_step_f32_decodes():
    step = decode_client_message(STEP_F32_BYTES, Limits(hidden_size=1))
    assert step.wire_dtype == "float32" and step.hidden.dtype == torch.float32
    assert step.hidden.tolist() == [[1.0], [-2.5]]
    assert step.keep == () and step.positions == (0, 1)
    assert step.structure.kind == "matrix"
    assert step.structure.allowed(2).tolist() == [[True, False], [True, True]]


def test_golden_result_decodes():
    result = decode_server_message(RESULT_BYTES, LIMITS)
    assert isinstance(result, Result)
    assert (result.seq, result.committed, result.wire_dtype) == (7, 10, "bfloat16")
    assert result.compute_ms == 1.2346 and result.handle_ms == 2.5
    assert result.hidden.dtype == torch.bfloat16
    assert result.hidden.tolist() == [[1.0, -0.5], [3.0, 65536.0]]


@pytest.mark.parametrize("message, data", [(ERROR, ERROR_BYTES), (ERROR_NO_SEQ, ERROR_NO_SEQ_BYTES)])
def test_golden_error_decodes(message, data):
    assert decode_server_message(data, LIMITS) == message


def test_golden_close_decodes():
    assert decode_client_message(CLOSE_BYTES, LIMITS) == Close()


def test_error_from_exception_keeps_code_and_message():
    err = Error.from_exception(ProtocolError("bad field."), seq=9)
    assert err == Error("protocol", "bad field.", 9)
    assert decode_server_message(err.encode(), LIMITS) == err


def test_non_ascii_header_text_is_escaped():
    # json.dumps' default ensure_ascii: the header stays 7-bit, and the text comes back intact.
    data = Error("config", "caf\u00e9").encode()
    assert b'"caf\\u00e9"' in data
    assert decode_server_message(data, LIMITS).message == "caf\u00e9"


# --------------------------------------------------------------------------------------------------
# Framing
# --------------------------------------------------------------------------------------------------


def test_decode_frame_splits_header_and_body():
    header, body = decode_frame(b'\x00\x00\x00\x07{"a":1}tail')
    assert header == {"a": 1}
    assert isinstance(body, memoryview) and bytes(body) == b"tail"


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_decode_frame_accepts_binary_types(kind):
    header, body = decode_frame(kind(b'\x00\x00\x00\x02{}xy'))
    assert header == {} and bytes(body) == b"xy"


def test_encode_frame_rejects_oversized_header():
    with pytest.raises(MessageTooLarge, match="limit is 65536"):
        encode_frame({"x": "a" * MAX_HEADER_BYTES})


def _frame(raw_header: bytes, body: bytes = b"") -> bytes:
    return struct.pack(">I", len(raw_header)) + raw_header + body


@pytest.mark.parametrize(
    "data, match",
    [
        (b"", "0 bytes, shorter than its 4-byte length prefix"),
        (b"\x00\x00\x00", "3 bytes, shorter"),
        (b"\x00\x00\x00\x10{}", "header length 16 is impossible for a 6-byte message"),
        (b"\xff\xff\xff\xff{}", "header length 4294967295 is impossible"),
        # Over the header limit even though the bytes are there.
        (struct.pack(">I", MAX_HEADER_BYTES + 1) + b" " * (MAX_HEADER_BYTES + 1), "impossible"),
        (_frame(b'{"a":"\xff\xfe"}'), "not valid UTF-8 JSON"),
        (_frame(b"{not json"), "not valid UTF-8 JSON"),
        (_frame(b""), "not valid UTF-8 JSON"),
        (_frame(b"[1,2]"), "must be a JSON object"),
        (_frame(b'"hello"'), "must be a JSON object"),
        (_frame(b"null"), "must be a JSON object"),
        (_frame(b'{"a":NaN}'), "NaN is not allowed"),
        (_frame(b'{"a":Infinity}'), "Infinity is not allowed"),
        (_frame(b'{"a":[-Infinity]}'), "Infinity is not allowed"),
    ],
)
def test_decode_frame_rejects(data, match):
    with pytest.raises(ProtocolError, match=match):
        decode_frame(data)


def test_decode_frame_rejects_text_messages():
    with pytest.raises(ProtocolError, match="text messages are not part of the protocol"):
        decode_frame('\x00\x00\x00\x02{}')
    with pytest.raises(ProtocolError, match="text messages"):
        decode_client_message('{"type":"close"}', LIMITS)
    with pytest.raises(ProtocolError, match="text messages"):
        decode_server_message('{"type":"error"}', LIMITS)


@pytest.mark.parametrize("nesting", [b"[" * 5000, b'{"a":' * 5000])
def test_decode_frame_rejects_deeply_nested_header(nesting):
    # Fits in the 64 KiB header limit; a peer can send it.
    with pytest.raises(ProtocolError):
        decode_frame(_frame(nesting))


# --------------------------------------------------------------------------------------------------
# Tensor codec
# --------------------------------------------------------------------------------------------------

_F16 = {"dtype": "float16", "shape": [2, 4]}
_ALL = tuple(WIRE_DTYPES)


def _decode(spec, body, *, max_rows=8, width=4, allowed=_ALL):
    return decode_tensor(spec, memoryview(body), max_rows=max_rows, width=width, allowed=allowed)


@pytest.mark.parametrize(
    "spec, body, kwargs, match",
    [
        ([2, 4], b"\x00" * 16, {}, "must be an object with 'dtype' and 'shape'"),
        ({"dtype": "int8", "shape": [2, 4]}, b"\x00" * 8, {}, "dtype 'int8' is not accepted here; use one of float16"),
        ({"shape": [2, 4]}, b"\x00" * 16, {}, "dtype None is not accepted"),
        (_F16, b"\x00" * 16, {"allowed": ("bfloat16",)}, "dtype 'float16' is not accepted here; use one of bfloat16"),
        ({"dtype": "float16", "shape": [8]}, b"\x00" * 16, {}, "list of two integers"),
        ({"dtype": "float16", "shape": [1, 2, 4]}, b"\x00" * 16, {}, "list of two integers"),
        ({"dtype": "float16", "shape": "2x4"}, b"\x00" * 16, {}, "list of two integers"),
        ({"dtype": "float16", "shape": [2, "4"]}, b"\x00" * 16, {}, "list of two integers"),
        ({"dtype": "float16", "shape": [2.0, 4]}, b"\x00" * 16, {}, "list of two integers"),
        ({"dtype": "float16", "shape": [True, 4]}, b"\x00" * 8, {}, "list of two integers"),
        ({"dtype": "float16", "shape": [2, 3]}, b"\x00" * 12, {}, "3 columns but the model's hidden size is 4"),
        ({"dtype": "float16", "shape": [0, 4]}, b"", {}, "0 rows; between 1 and 8"),
        ({"dtype": "float16", "shape": [-1, 4]}, b"", {}, "-1 rows"),
        ({"dtype": "float16", "shape": [9, 4]}, b"\x00" * 72, {}, "9 rows; between 1 and 8"),
        (_F16, b"\x00" * 15, {}, r"body is 15 bytes; shape \[2, 4\] in float16 needs 16"),
        (_F16, b"\x00" * 17, {}, "body is 17 bytes"),
        ({"dtype": "float32", "shape": [2, 4]}, b"\x00" * 16, {}, "in float32 needs 32"),
    ],
)
def test_decode_tensor_rejects(spec, body, kwargs, match):
    with pytest.raises(ProtocolError, match=match):
        _decode(spec, body, **kwargs)


@pytest.mark.parametrize(
    "dtype, bad",
    [
        ("float16", b"\x00\x7e"),  # NaN
        ("float16", b"\x00\x7c"),  # +inf
        ("float16", b"\x00\xfc"),  # -inf
        ("bfloat16", b"\xc0\x7f"),  # NaN
        ("bfloat16", b"\x80\xff"),  # -inf
        ("float32", b"\x00\x00\xc0\x7f"),  # NaN
        ("float32", b"\x00\x00\x80\x7f"),  # +inf
    ],
)
def test_decode_tensor_rejects_non_finite(dtype, bad):
    good = torch.ones(2, 4, dtype=WIRE_DTYPES[dtype]).view(torch.uint8).numpy().tobytes()
    body = good[: -len(bad)] + bad  # only the last element is bad
    assert _decode({"dtype": dtype, "shape": [2, 4]}, good).eq(1).all()
    with pytest.raises(ProtocolError, match="NaN or infinity"):
        _decode({"dtype": dtype, "shape": [2, 4]}, body)


def test_decode_tensor_copies_out_of_the_frame():
    body = bytearray(b"\x00\x3c" * 8)  # eight float16 ones
    tensor = _decode(_F16, body)
    body[:2] = b"\x00\x40"  # 2.0 in the frame after decoding
    assert tensor.tolist() == [[1.0] * 4] * 2


def test_encode_tensor_rejects_float16_overflow():
    hidden = torch.tensor([[1.0, 1e6]])
    with pytest.raises(ProtocolError, match="not finite in float16; use a bfloat16 or float32 wire"):
        encode_tensor(hidden, "float16")
    spec, raw = encode_tensor(hidden, "bfloat16")  # the same values fit a bfloat16 wire
    assert spec == {"dtype": "bfloat16", "shape": [1, 2]} and len(raw) == 4


@pytest.mark.parametrize("dtype", _ALL)
def test_encode_tensor_rejects_nan_input(dtype):
    with pytest.raises(ProtocolError, match="not finite"):
        encode_tensor(torch.tensor([[0.0, float("nan")]]), dtype)


def test_encode_tensor_rejects_unknown_dtype():
    with pytest.raises(ProtocolError, match="wire dtype must be one of float16, bfloat16, float32, not 'int8'"):
        encode_tensor(torch.zeros(1, 2), "int8")


def test_encode_tensor_writes_row_major_bytes_for_a_transposed_view():
    hidden = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).T  # non-contiguous: logical rows [1, 3], [2, 4]
    spec, raw = encode_tensor(hidden, "float16")
    # float16: 1.0 = 0x3c00, 3.0 = 0x4200, 2.0 = 0x4000, 4.0 = 0x4400
    assert spec == {"dtype": "float16", "shape": [2, 2]}
    assert raw == b"\x00\x3c\x00\x42\x00\x40\x00\x44"


def test_encode_tensor_rounds_to_the_wire_dtype():
    spec, raw = encode_tensor(torch.tensor([[1.0 + 2**-12]]), "float16")  # below half's resolution at 1.0
    assert raw == b"\x00\x3c"


# --------------------------------------------------------------------------------------------------
# Field validation
# --------------------------------------------------------------------------------------------------

_DELETE = object()


def _hello_header() -> dict:
    return json.loads(HELLO_BYTES[4:])


def _step_parts() -> tuple[dict, bytes]:
    return json.loads(STEP_BYTES[4:154]), STEP_BYTES[154:]


def _set(header: dict, path: tuple, value) -> dict:
    header = copy.deepcopy(header)
    target = header
    for key in path[:-1]:
        target = target[key]
    if value is _DELETE:
        target.pop(path[-1], None)
    else:
        target[path[-1]] = value
    return header


def test_step_parts_helper_matches_golden():
    header, body = _step_parts()
    assert encode_frame(header, body) == STEP_BYTES


@pytest.mark.parametrize(
    "path, value, match",
    [
        (("fingerprint",), _DELETE, "'fingerprint' must be a non-empty string"),
        (("fingerprint",), "", "'fingerprint' must be a non-empty string"),
        (("fingerprint",), "f" * 129, "at most 128 characters"),
        (("fingerprint",), 12, "'fingerprint'"),
        (("cloud_layers",), _DELETE, "'cloud_layers' must be a list"),
        (("cloud_layers",), [2], r"'cloud_layers' must be \[start, end\)"),
        (("cloud_layers",), [2, 5, 7], "'cloud_layers' must be a list of at most 2"),
        (("cloud_layers",), [2, "5"], "'cloud_layers' must be an integer"),
        (("cloud_layers",), [-1, 5], "'cloud_layers' must be an integer"),
        (("cloud_layers",), [2, True], "'cloud_layers' must be an integer"),
        (("cloud_layers",), "2-5", "'cloud_layers' must be a list"),
        (("wire_dtype",), "int8", "wire dtype 'int8' is not accepted"),
        (("wire_dtype",), _DELETE, "wire dtype None is not accepted"),
        (("session_id",), 5, "'session_id'"),
        (("session_id",), "", "'session_id'"),
        (("version",), _DELETE, "'version' must be an integer"),
        (("version",), True, "'version' must be an integer"),
        (("version",), -1, "'version' must be an integer"),
    ],
)
def test_hello_field_validation(path, value, match):
    data = encode_frame(_set(_hello_header(), path, value))
    with pytest.raises(ProtocolError, match=match):
        decode_client_message(data, LIMITS)


def test_hello_dtype_must_be_one_the_server_accepts():
    with pytest.raises(ProtocolError, match="wire dtype 'float16' is not accepted; use one of bfloat16"):
        decode_client_message(HELLO_BYTES, Limits(hidden_size=2, dtypes=("bfloat16",)))


@pytest.mark.parametrize(
    "path, value, match",
    [
        (("positions",), [5], "'positions' has 1 entries for 2 rows"),
        (("positions",), [5, 6, 7], "'positions' must be a list of at most 2"),
        (("positions",), [-1, 0], "'positions' must be an integer"),
        (("positions",), [0, MAX_POSITION + 1], "'positions' must be an integer"),
        (("positions",), _DELETE, "'positions' must be a list"),
        (("keep",), [[2, 1], [0, 1]], "'keep' runs must be ascending and disjoint"),
        (("keep",), [[1, 2], [2, 1]], "'keep' runs must be ascending and disjoint"),
        (("keep",), [[64, 1]], "'keep' must be an integer in \\[0, 63\\]"),
        (("keep",), [[60, 5]], "'keep' must be an integer in \\[1, 4\\]"),
        (("keep",), [[0, 0]], "'keep' must be an integer in \\[1, 64\\]"),
        (("keep",), [[-1, 1]], "'keep' must be an integer"),
        (("keep",), [3], "'keep' must be a list of \\[start, count\\] runs"),
        (("keep",), _DELETE, "'keep' must be a list"),
        (("structure", "parents"), [-1, 1], "each earlier than its child"),
        (("structure", "parents"), [1, -1], "each earlier than its child"),
        (("structure", "parents"), [-1, 2], "'structure.parents' must be an integer in \\[-1, 1\\]"),
        (("structure", "parents"), [-1], "one parent per row"),
        (("structure", "parents"), [-2, 0], "'structure.parents' must be an integer"),
        (("structure", "parents"), _DELETE, "'structure.parents' must be a list"),
        (("structure",), {"kind": "matrix", "bits": "b"}, "matrix bits must be 1 bytes of hex for a 2-row block"),
        (("structure",), {"kind": "matrix", "bits": "b0b0"}, "matrix bits must be 1 bytes"),
        (("structure",), {"kind": "matrix", "bits": 176}, "matrix bits must be 1 bytes"),
        (("structure",), {"kind": "matrix"}, "matrix bits must be 1 bytes"),
        (("structure",), {"kind": "matrix", "bits": "zz"}, "matrix bits are not valid hex"),
        (("structure",), {"kind": "matrix", "bits": "80"}, "set the diagonal"),  # 1000: row 1 cannot see itself
        (("structure",), {"kind": "matrix", "bits": "30"}, "set the diagonal"),  # 0011: row 0 cannot see itself
        (("structure",), {"kind": "dag"}, "field 'structure' must be an object with kind in"),
        (("structure",), ["chain"], "field 'structure' must be an object"),
        (("structure",), _DELETE, "field 'structure' must be an object"),
        (("seq",), -1, "'seq' must be an integer"),
        (("seq",), True, "'seq' must be an integer"),
        (("seq",), 3.0, "'seq' must be an integer"),
        (("seq",), "3", "'seq' must be an integer"),
        (("seq",), _DELETE, "'seq' must be an integer"),
        (("tensor",), _DELETE, "'tensor' must be an object"),
        (("tensor", "dtype"), "float64", "dtype 'float64' is not accepted"),
        (("tensor", "shape"), [2, 3], "3 columns"),
        (("tensor", "shape"), [1, 2], "body is 8 bytes; shape \\[1, 2\\] in float16 needs 4"),
        (("type",), "ping", "unknown client message type 'ping'; expected hello, step or close"),
        (("type",), "result", "unknown client message type 'result'"),
        (("type",), _DELETE, "unknown client message type None"),
    ],
)
def test_step_field_validation(path, value, match):
    header, body = _step_parts()
    data = encode_frame(_set(header, path, value), body)
    with pytest.raises(ProtocolError, match=match):
        decode_client_message(data, LIMITS)


@pytest.mark.parametrize(
    "path, value",
    [
        (("structure",), {"kind": "chain"}),
        (("structure",), {"kind": "matrix", "bits": "d0"}),  # 1101: row 0 also sees row 1; allowed in a matrix
        (("structure", "parents"), [-1, -1]),  # two roots
        (("keep",), []),
        (("keep",), [[63, 1]]),
        (("keep",), [[0, 2], [5, 3]]),
        (("seq",), 2**40),
    ],
)
def test_step_field_validation_accepts_valid_variants(path, value):
    header, body = _step_parts()
    step = decode_client_message(encode_frame(_set(header, path, value), body), LIMITS)
    assert isinstance(step, Step)
    assert step.structure.as_dict() == _set(header, path, value)["structure"]


def test_step_rejects_more_rows_than_the_limit():
    with pytest.raises(ProtocolError, match="2 rows; between 1 and 1 are accepted"):
        decode_client_message(STEP_BYTES, Limits(hidden_size=2, max_block_rows=1))


@pytest.mark.parametrize(
    "data, match",
    [
        (encode_frame({**json.loads(RESULT_BYTES[4:124]), "compute_ms": -1}, RESULT_BYTES[124:]), "'compute_ms'"),
        (encode_frame({**json.loads(RESULT_BYTES[4:124]), "handle_ms": True}, RESULT_BYTES[124:]), "'handle_ms'"),
        (encode_frame({**json.loads(RESULT_BYTES[4:124]), "handle_ms": "2"}, RESULT_BYTES[124:]), "'handle_ms'"),
        # 1e999 is legal JSON text that parses to inf; only the float check stands in its way.
        (_frame(RESULT_BYTES[4:124].replace(b"2.5", b"1e999"), RESULT_BYTES[124:]), "'handle_ms' must be a finite"),
        (encode_frame({**json.loads(RESULT_BYTES[4:124]), "committed": -1}, RESULT_BYTES[124:]), "'committed'"),
        (encode_frame({**json.loads(WELCOME_BYTES[4:]), "max_message_bytes": 1023}), "'max_message_bytes'"),
        (encode_frame({**json.loads(WELCOME_BYTES[4:]), "max_block_rows": 0}), "'max_block_rows'"),
        (encode_frame({**json.loads(WELCOME_BYTES[4:]), "session_id": None}), "'session_id'"),
        (encode_frame({**json.loads(ERROR_BYTES[4:]), "seq": -4}), "'seq'"),
        (encode_frame({**json.loads(ERROR_BYTES[4:]), "code": ""}), "'code'"),
        (encode_frame({**json.loads(ERROR_BYTES[4:]), "message": None}), "'message'"),
        (HELLO_BYTES, "unknown server message type 'hello'; expected welcome, result or error"),
    ],
)
def test_server_message_field_validation(data, match):
    with pytest.raises(ProtocolError, match=match):
        decode_server_message(data, LIMITS)


def test_result_golden_header_slice_is_the_whole_header():
    # Guards the slices used above: [4:124] is the header and [124:] the 8-byte body.
    assert encode_frame(json.loads(RESULT_BYTES[4:124]), RESULT_BYTES[124:]) == RESULT_BYTES


@pytest.mark.parametrize(
    "value",
    [
        "x" * 5000,  # the reply's message is over 4096 characters: the client cannot decode it
        # A 30 KB request whose repr'd, re-escaped echo is a 90 KB reply: Error.encode raises MessageTooLarge.
        "\"" + "'" * 30000,
    ],
    ids=["over-4096", "over-64KiB"],
)
def test_error_frame_for_a_rejected_field_decodes_on_the_client(value):
    data = encode_frame({**_hello_header(), "version": value})
    with pytest.raises(ProtocolError) as info:
        decode_client_message(data, LIMITS)
    reply = Error.from_exception(info.value).encode()
    assert decode_server_message(reply, LIMITS).code == "protocol"


# --------------------------------------------------------------------------------------------------
# Property tests
# --------------------------------------------------------------------------------------------------

# dtype -> (unsigned word, signed view, exponent mask, top exponent bit). A word whose exponent bits are
# all ones is inf or NaN; clearing the top exponent bit makes it an ordinary finite value.
_WORDS = {
    "float16": (np.uint16, np.int16, 0x7C00, 0x4000),
    "bfloat16": (np.uint16, np.int16, 0x7F80, 0x4000),
    "float32": (np.uint32, np.int32, 0x7F800000, 0x40000000),
}


@st.composite
def finite_tensors(draw, q: int, d: int, dtype: str) -> torch.Tensor:
    """Any finite value of the dtype (subnormals and -0.0 included), drawn as raw bit patterns."""
    unsigned, signed, exp_mask, top = _WORDS[dtype]
    width = np.dtype(unsigned).itemsize
    raw = draw(st.binary(min_size=q * d * width, max_size=q * d * width))
    words = np.frombuffer(raw, dtype=unsigned).copy()
    words = np.where((words & exp_mask) == exp_mask, words & unsigned(~top & (2 ** (8 * width) - 1)), words)
    tensor = torch.from_numpy(words.astype(unsigned).view(signed).copy()).view(WIRE_DTYPES[dtype]).reshape(q, d)
    assert bool(torch.isfinite(tensor).all())
    return tensor


@st.composite
def structures(draw, q: int) -> BlockStructure:
    kind = draw(st.sampled_from(STRUCTURE_KINDS))
    if kind == "chain":
        return BlockStructure.chain()
    if kind == "tree":
        return BlockStructure.tree([draw(st.integers(-1, i - 1)) for i in range(q)])
    flat = draw(st.lists(st.booleans(), min_size=q * q, max_size=q * q))
    allowed = np.array(flat, dtype=bool).reshape(q, q)
    np.fill_diagonal(allowed, True)
    return BlockStructure.matrix(allowed)


@st.composite
def steps(draw) -> tuple[Step, Limits]:
    q = draw(st.integers(1, 16))
    d = draw(st.integers(1, 32))
    dtype = draw(st.sampled_from(_ALL))
    limits = Limits(hidden_size=d, max_block_rows=64)
    step = Step(
        seq=draw(st.integers(0, 2**53)),
        keep=tuple(sorted(draw(st.sets(st.integers(0, 63), max_size=16)))),
        positions=tuple(draw(st.lists(st.integers(0, MAX_POSITION), min_size=q, max_size=q))),
        structure=draw(structures(q)),
        hidden=draw(finite_tensors(q, d, dtype)),
        wire_dtype=dtype,
    )
    return step, limits


@FUZZ
@given(steps())
def test_step_round_trips_exactly(case):
    step, limits = case
    decoded = decode_client_message(step.encode(), limits)
    assert isinstance(decoded, Step)
    assert (decoded.seq, decoded.keep, decoded.positions, decoded.wire_dtype) == (
        step.seq,
        step.keep,
        step.positions,
        step.wire_dtype,
    )
    assert decoded.structure == step.structure
    q = step.hidden.shape[0]
    assert np.array_equal(decoded.structure.allowed(q), step.structure.allowed(q))
    assert decoded.hidden.dtype == step.hidden.dtype and decoded.hidden.shape == step.hidden.shape
    assert torch.equal(_bits(decoded.hidden), _bits(step.hidden))


@FUZZ
@given(st.data())
def test_result_round_trips_exactly(data):
    q, d = data.draw(st.integers(1, 16)), data.draw(st.integers(1, 32))
    dtype = data.draw(st.sampled_from(_ALL))
    ms = st.floats(0, 1e6, allow_nan=False)
    result = Result(
        seq=data.draw(st.integers(0, 2**53)),
        hidden=data.draw(finite_tensors(q, d, dtype)),
        compute_ms=data.draw(ms),
        handle_ms=data.draw(ms),
        committed=data.draw(st.integers(0, 2**31)),
        wire_dtype=dtype,
    )
    decoded = decode_server_message(result.encode(), Limits(hidden_size=d, max_block_rows=16))
    assert (decoded.seq, decoded.committed, decoded.wire_dtype) == (result.seq, result.committed, dtype)
    assert decoded.compute_ms == round(result.compute_ms, 4) and decoded.handle_ms == round(result.handle_ms, 4)
    assert torch.equal(_bits(decoded.hidden), _bits(result.hidden))


# Fuzzing: whatever arrives, the decoders raise only the package's own errors.

FUZZ_LIMITS = Limits(hidden_size=2, max_block_rows=64)
VALID_MESSAGES = [HELLO_BYTES, WELCOME_BYTES, STEP_BYTES, RESULT_BYTES, ERROR_BYTES, ERROR_NO_SEQ_BYTES, CLOSE_BYTES]


def _decode_both(data) -> None:
    for decode in (decode_client_message, decode_server_message):
        try:
            decode(data, FUZZ_LIMITS)
        except SplitInferError:
            pass  # anything else propagates and fails the test


def test_fuzz_corpus_is_valid():
    # The mutations below start from messages that decode, so they reach the field checks.
    for data in VALID_MESSAGES:
        try:
            decode_client_message(data, FUZZ_LIMITS)
        except ProtocolError:
            decode_server_message(data, FUZZ_LIMITS)


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_raise_only_splitinfer_errors(data):
    _decode_both(data)


@FUZZ
@given(st.binary(max_size=200), st.binary(max_size=40))
def test_random_header_bytes_raise_only_splitinfer_errors(header, body):
    _decode_both(_frame(header, body))


@FUZZ
@given(
    st.sampled_from(VALID_MESSAGES),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=6),
    st.one_of(st.none(), st.integers(0, 300)),
)
def test_byte_mutations_raise_only_splitinfer_errors(message, edits, cut):
    data = bytearray(message)
    for position, byte in edits:
        data[position % len(data)] = byte
    if cut is not None:
        data = data[:cut]
    _decode_both(bytes(data))


_JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6)
    | st.sampled_from(["float16", "bfloat16", "float32", "chain", "tree", "matrix", "b0", "ff", "step", "hello"])
)
_JSON = st.recursive(
    _JSON_LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8,
)
_PATHS = [
    ("type",), ("version",), ("fingerprint",), ("cloud_layers",), ("wire_dtype",), ("session_id",),
    ("seq",), ("keep",), ("positions",), ("structure",), ("structure", "kind"), ("structure", "parents"),
    ("structure", "bits"), ("tensor",), ("tensor", "dtype"), ("tensor", "shape"), ("compute_ms",),
    ("handle_ms",), ("committed",), ("next_seq",), ("resumed",), ("max_message_bytes",), ("max_block_rows",),
    ("code",), ("message",),
]  # fmt: skip


def _set_if_reachable(header: dict, path: tuple, value) -> dict:
    target = header
    for key in path[:-1]:
        if not isinstance(target.get(key), dict):
            return header
        target = target[key]
    if value is _DELETE:
        target.pop(path[-1], None)
    else:
        target[path[-1]] = value
    return header


@FUZZ
@given(
    st.sampled_from(VALID_MESSAGES),
    st.lists(st.tuples(st.sampled_from(_PATHS), st.just(_DELETE) | _JSON), min_size=1, max_size=3),
)
def test_header_field_mutations_raise_only_splitinfer_errors(message, edits):
    (length,) = struct.unpack(">I", message[:4])
    header, body = json.loads(message[4 : 4 + length]), message[4 + length :]
    for path, value in edits:
        header = _set_if_reachable(header, path, value)
    _decode_both(encode_frame(header, body))
