"""Frames padded to fixed sizes, so a network observer with TLS intact cannot read a block's row count, its
keep list or its positions from the message length (threat T6, docs/privacy.md). Sans-I/O.

A padded frame says `"pad": n` in its header and carries n zero bytes after its body; `decode_frame` strips
them before anything reads the body, so padding is never a row and the cloud computes nothing for it.
Sizes come from one ladder, HEADER_ALLOWANCE + k * quantum bytes (k >= 1), the smallest that holds the
frame; quantum is `pad_rows` rows of hidden state in the wire dtype. With `pad_rows` at least the largest
decode block, every decode step and every reply has the same size; a prompt's chunks round up to a
multiple of it. Timing is not hidden: the cloud's pass still takes as long as the real rows take.
"""

from __future__ import annotations

import json
import struct

# Room for the JSON header of a block up to a few hundred rows (positions, parents, keep runs), so that a
# block of exactly k * pad_rows rows stays in its bucket. A larger header only moves the frame one bucket up.
HEADER_ALLOWANCE = 4096
_LENGTH = struct.Struct(">I")
_SLACK = 32  # bytes reserved for the pad field itself (`,"pad":n` and one space)


def padded_size(length: int, quantum: int) -> int:
    """The ladder's smallest size that holds `length` bytes: HEADER_ALLOWANCE + k * quantum, k >= 1."""
    assert quantum > 0, quantum
    k = max(1, -(-(length - HEADER_ALLOWANCE) // quantum))
    return HEADER_ALLOWANCE + k * quantum


def pad_frame(frame: bytes, quantum: int) -> bytes:
    """`frame` (an encoded message) grown to the ladder size for `quantum`: a `pad` count in its header and
    that many zero bytes after its body. quantum 0 returns it as it is."""
    if quantum <= 0:
        return frame
    (length,) = _LENGTH.unpack(frame[:4])
    header, body = json.loads(frame[4 : 4 + length]), frame[4 + length :]
    target = padded_size(len(frame) + _SLACK, quantum)
    header["pad"] = 0
    first = target - 4 - len(_dump(header)) - len(body)  # the count if it had one digit
    header["pad"] = pad = first - (len(str(first)) - 1)
    raw = _dump(header)
    raw += b" " * (target - 4 - len(raw) - len(body) - pad)  # 0 or 1: JSON allows trailing whitespace
    out = b"".join((_LENGTH.pack(len(raw)), raw, body, bytes(pad)))
    assert len(out) == target, (len(out), target)
    return out


def _dump(header: dict) -> bytes:
    return json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
