"""Frames padded to fixed sizes, so a network observer with TLS intact cannot read a block's row count, its
keep list or its positions from the message length (threat T6, docs/privacy.md). Sans-I/O.

A padded frame says `"pad": n` in its header and carries n zero bytes after its body; `decode_frame` strips
them before anything reads the body, so padding is never a row and the cloud computes nothing for it.
Sizes come from one ladder, HEADER_ALLOWANCE + k * quantum bytes (k >= 1), the smallest that holds the
frame; quantum is `pad_rows` rows of hidden state in the wire dtype. With `pad_rows` at least the largest
decode block, every decode step and every reply has the same size; a prompt's chunks round up to a
multiple of it. Timing is padded separately (a step's `hold_ms`, the client's pacing) and a reply's number of
steps by cover exchanges (cover.py); `PadSetting` names a combination of all of them.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass

from ..errors import ConfigError

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


_SETTING = re.compile(r"(\d+)((?:\+[sht]\d+)*)")
_PARTS = {"s": "steps", "h": "hold_ms", "t": "think_ms"}


@dataclass(frozen=True)
class PadSetting:
    """One padding configuration, named as benchmarks and the audit take it: ROWS[+sSTEPS][+hHOLD][+tTHINK],
    e.g. 33+s64+h110+t50 (ClientConfig's pad_rows, pad_steps, pad_hold_ms, pad_think_ms); "0" is none."""

    rows: int = 0
    steps: int = 0
    hold_ms: int = 0
    think_ms: int = 0

    @classmethod
    def parse(cls, text: str) -> PadSetting:
        match = _SETTING.fullmatch(str(text).strip())
        if match is None:
            raise ValueError(f"a padding setting is ROWS[+sSTEPS][+hHOLD_MS][+tTHINK_MS], e.g. 33+s64+h110+t50, "
                             f"not {text!r}")
        parts = {_PARTS[p[0]]: int(p[1:]) for p in match.group(2).split("+") if p}
        setting = cls(int(match.group(1)), **parts)
        if not setting.rows and setting != cls():
            raise ValueError(f"steps and timing pad only with rows padded (ROWS > 0), not {text!r}")
        return setting

    @property
    def key(self) -> str:
        parts = zip("sht", (self.steps, self.hold_ms, self.think_ms))
        return f"{self.rows}" + "".join(f"+{c}{value}" for c, value in parts if value)

    def client_fields(self) -> dict:
        """The ClientConfig fields this setting sets."""
        return {"pad_rows": self.rows, "pad_steps": self.steps, "pad_hold_ms": self.hold_ms,
                "pad_think_ms": self.think_ms}


def parse_pad_settings(text: str) -> list[PadSetting]:
    """`--pad-rows`: comma-separated PadSetting names, e.g. 0,33,33+s64, without repeats; ConfigError when one is
    malformed or none is given."""
    try:
        settings = [PadSetting.parse(v) for v in str(text).split(",") if v.strip()]
    except ValueError as exc:
        raise ConfigError(f"--pad-rows: {exc}.") from exc
    if not settings:
        raise ConfigError("--pad-rows takes padding settings like 0,33,33+s64 (0: none).")
    return list(dict.fromkeys(settings))
