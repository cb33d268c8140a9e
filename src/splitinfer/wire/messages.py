"""The protocol's messages: frozen dataclasses with `encode()` and validated decoding (sans-I/O).

    client -> server   Hello   open or resume a session; pins the cloud shard fingerprint and split (and,
                               under split-point randomisation, the session's head depth k)
                       Step    one block: hidden states [q, d] + positions + block structure, and the
                               rows of the previous block to keep (lazy KV commit); from v3, the earlier
                               blocks still in flight it assumes accepted, with the rows it assumes kept
                       Close   end the session and free its cache
                       Probe   N payload bytes, asking for M reply bytes (path measurement; no session),
                               optionally held H ms before the reply (cover exchanges, wire/cover.py)
    server -> client   Welcome the session id and the limits the client must respect
                       Result  hidden states [q, d] for the block, with the server's timings; from v3, no
                               rows (`skipped`) for a block a later step had dropped before it ran
                       Error   a code from errors.py and a sentence
                       ProbeReply  the M bytes a Probe asked for, and how many it received

Every field is checked (type, range, shape, dtype, finiteness) here, before anything reaches a model.
Consistency with the session (positions, keep lists) is checked by the cloud session, which knows it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ProtocolError, SplitInferError
from ..masks import STRUCTURE_KINDS, BlockStructure
from .frame import (
    WIRE_DTYPES,
    check_int,
    check_int_list,
    check_str,
    decode_frame,
    decode_tensor,
    encode_frame,
    encode_tensor,
    show,
)
from .padding import pad_frame

PROTOCOL_VERSION = 1  # the base protocol: every message, and every hello that does not pin a head depth
# A hello that pins its head depth (split-point randomisation) says v2, so a server from before the
# feature refuses it with a version error instead of ignoring the field and running the wrong layers.
# Hellos without it stay v1, byte for byte, so old servers and old clients keep working with new ones.
SPLIT_PIN_VERSION = 2
# A hello that says v3 asks for blocks in flight: its steps may name earlier unresolved blocks they assume
# accepted (`assume`), and its welcome says how many blocks may be in flight. A server from before refuses
# the hello with a version error, and the client falls back to one block at a time.
PIPELINE_VERSION = 3
SUPPORTED_VERSIONS = (PROTOCOL_VERSION, SPLIT_PIN_VERSION, PIPELINE_VERSION)
MAX_ASSUMED = 8  # earlier blocks one step may assume; the server's own limit (welcome) is smaller
MAX_POSITION = 1 << 24
MAX_ERROR_CHARS = 1000  # error sentences are cut here; peers' values are quoted shorter still
MAX_PROBE_BYTES = 1 << 30  # decoder bound on a probe's reply size; the server applies its message limit
MAX_HOLD_MS = 10_000  # a step or probe may ask its reply held this long at most (T6 timing padding, cover exchanges)
MAX_PAD_QUANTUM = 1 << 24  # bytes: a step may ask for its reply padded to multiples of at most this


@dataclass(frozen=True)
class Limits:
    """What a decoder needs to know to validate tensors."""

    hidden_size: int
    max_block_rows: int = 1024  # rows per Step (prefill chunks included)
    dtypes: tuple[str, ...] = tuple(WIRE_DTYPES)


@dataclass(frozen=True)
class Hello:
    fingerprint: str  # the cloud shard fingerprint from the client's local manifest
    cloud_layers: tuple[int, int]  # [start, end) the client expects the server to hold
    wire_dtype: str  # dtype of hidden states in both directions
    session_id: str | None = None  # resume this session if the server still has it
    version: int | None = None  # None: SPLIT_PIN_VERSION when head_layers is pinned, else PROTOCOL_VERSION
    # k: this session runs layers [0, k) locally and the cloud runs [k, end). None: k = cloud_layers[0].
    head_layers: int | None = None

    def __post_init__(self):
        if self.version is None:
            object.__setattr__(self, "version", SPLIT_PIN_VERSION if self.head_layers is not None else PROTOCOL_VERSION)

    def encode(self) -> bytes:
        header = {
            "type": "hello",
            "version": self.version,
            "fingerprint": self.fingerprint,
            "cloud_layers": list(self.cloud_layers),
            "wire_dtype": self.wire_dtype,
            "session_id": self.session_id,
        }
        if self.head_layers is not None:
            header["head_layers"] = self.head_layers
        return encode_frame(header)


@dataclass(frozen=True)
class Welcome:
    session_id: str
    committed: int  # rows the server holds for this session (0 for a new one)
    resumed: bool  # True when session_id was an existing session
    max_message_bytes: int
    max_block_rows: int
    next_seq: int = 0  # the seq the server expects next (a resumed client checks it)
    version: int = PROTOCOL_VERSION
    max_in_flight: int = 1  # blocks a v3 session may have in flight (pending on the server) at once

    def encode(self) -> bytes:
        header = {
            "type": "welcome",
            "next_seq": self.next_seq,
            "version": self.version,
            "session_id": self.session_id,
            "committed": self.committed,
            "resumed": self.resumed,
            "max_message_bytes": self.max_message_bytes,
            "max_block_rows": self.max_block_rows,
        }
        if self.version >= PIPELINE_VERSION:
            header["max_in_flight"] = self.max_in_flight
        return encode_frame(header)


@dataclass(frozen=True)
class Assumed:
    """An earlier block still in flight that a step builds on, and the rows of it the step assumes kept."""

    seq: int
    rows: tuple[int, ...]  # ascending block rows: a contiguous path from the block's root


@dataclass(frozen=True, eq=False)
class Step:
    seq: int  # request counter of the session, echoed in the Result
    keep: tuple[int, ...]  # rows of the previous (pending) block to commit, ascending; () drops it
    positions: tuple[int, ...]  # absolute position of each row of this block
    structure: BlockStructure
    hidden: torch.Tensor  # [q, d]
    wire_dtype: str = "float16"
    assume: tuple[Assumed, ...] = ()  # v3: earlier blocks in flight, oldest first, this block assumes accepted
    resolved: int = 0  # v3: the first `resolved` of `assume` are already resolved: commit them after `keep`
    # bytes: pad this frame, and ask for the reply padded, to wire/padding.py's ladder (threat T6); 0: unpadded
    pad_quantum: int = 0
    hold_ms: int = 0  # the server sends the reply no sooner than this many ms after the step arrived (T6); 0: at once

    def encode(self) -> bytes:
        spec, raw = encode_tensor(self.hidden, self.wire_dtype)
        header = {
            "type": "step",
            "seq": self.seq,
            "keep": keep_runs(self.keep),
            "positions": list(self.positions),
            "structure": self.structure.as_dict(),
            "tensor": spec,
        }
        if self.assume:  # absent otherwise, so a step without assumptions is the v1 step byte for byte
            header["assume"] = [{"seq": a.seq, "keep": keep_runs(a.rows)} for a in self.assume]
        if self.resolved:
            header["resolved"] = self.resolved
        if self.pad_quantum:
            header["reply_pad"] = self.pad_quantum
        if self.hold_ms:
            header["hold_ms"] = self.hold_ms
        return pad_frame(encode_frame(header, raw), self.pad_quantum)


@dataclass(frozen=True, eq=False)
class Result:
    seq: int
    hidden: torch.Tensor  # [q, d]; [0, d] when skipped
    compute_ms: float  # time the server spent in the middle layers for this block
    handle_ms: float  # time from receiving the request to having the reply encoded (>= compute_ms)
    committed: int  # the session's committed rows after applying `keep`, before this block
    wire_dtype: str = "float16"
    # v3: the block never ran, because a later step of its session, already received, builds on neither it
    # nor anything after it (the client dropped it); its keep list and resolutions were applied all the same
    skipped: bool = False
    pad_quantum: int = 0  # the step's reply_pad: this reply is padded to the same ladder as the step

    def encode(self) -> bytes:
        header = {
            "type": "result",
            "seq": self.seq,
            "compute_ms": round(self.compute_ms, 4),
            "handle_ms": round(self.handle_ms, 4),
            "committed": self.committed,
        }
        if self.skipped:  # absent otherwise, so every other result is the v1 result byte for byte
            header["skipped"] = True
            return pad_frame(encode_frame(header), self.pad_quantum)
        spec, raw = encode_tensor(self.hidden, self.wire_dtype)
        header["tensor"] = spec
        return pad_frame(encode_frame(header, raw), self.pad_quantum)


@dataclass(frozen=True)
class Error:
    code: str
    message: str
    seq: int | None = None

    @classmethod
    def from_exception(cls, exc: SplitInferError, seq: int | None = None) -> "Error":
        message = str(exc) or f"{type(exc).__name__} ({exc.code})"
        return cls(exc.code, message[:MAX_ERROR_CHARS], seq)

    def encode(self) -> bytes:
        return encode_frame({"type": "error", "code": self.code, "message": self.message, "seq": self.seq})


@dataclass(frozen=True)
class Close:
    def encode(self) -> bytes:
        return encode_frame({"type": "close"})


@dataclass(frozen=True)
class Probe:
    """Measures the path (round trip, bandwidth), or stands in for a step (cover traffic): answered without a
    session or any compute, after `hold_ms`."""

    seq: int
    reply_bytes: int  # size of the body the reply must carry
    payload: bytes = b""  # sent as the body; its content is ignored
    hold_ms: int = 0  # the server waits this long before replying, as a step's pass would take

    def encode(self) -> bytes:
        header = {"type": "probe", "seq": self.seq, "reply_bytes": self.reply_bytes}
        if self.hold_ms:  # absent otherwise: a plain probe is byte for byte the one older servers know
            header["hold_ms"] = self.hold_ms
        return encode_frame(header, self.payload)


@dataclass(frozen=True)
class ProbeReply:
    seq: int
    received: int  # body bytes of the Probe as the server got them
    payload: bytes = b""  # reply_bytes zero bytes

    def encode(self) -> bytes:
        return encode_frame({"type": "probe_reply", "seq": self.seq, "received": self.received}, self.payload)


ClientMessage = Hello | Step | Close | Probe
ServerMessage = Welcome | Result | Error | ProbeReply


def _check_version(header: dict) -> int:
    return check_int(header.get("version"), "version", 0, 1 << 16)


def _check_float(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ProtocolError(f"field {name!r} must be a finite non-negative number, got {show(value)}.")
    return float(value)


def keep_runs(rows: tuple[int, ...]) -> list[list[int]]:
    """Ascending rows as [start, count] runs: the first step after a 512-row prefill chunk names one run,
    not 512 numbers, so bytes per step stay flat whatever came before."""
    runs: list[list[int]] = []
    for r in rows:
        if runs and runs[-1][0] + runs[-1][1] == r:
            runs[-1][1] += 1
        else:
            runs.append([r, 1])
    return runs


def _decode_keep(value: object, max_rows: int) -> list[int]:
    if not isinstance(value, list) or len(value) > max_rows:
        raise ProtocolError(f"field 'keep' must be a list of at most {max_rows} [start, count] runs.")
    rows: list[int] = []
    for run in value:
        if not isinstance(run, list) or len(run) != 2:
            raise ProtocolError("field 'keep' must be a list of [start, count] runs.")
        start = check_int(run[0], "keep", 0, max_rows - 1)
        count = check_int(run[1], "keep", 1, max_rows - start)
        if rows and start <= rows[-1]:
            raise ProtocolError("field 'keep' runs must be ascending and disjoint.")
        rows.extend(range(start, start + count))
    return rows


def _decode_assume(value: object, seq: int, max_rows: int) -> tuple[Assumed, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_ASSUMED:
        raise ProtocolError(f"field 'assume' must be a list of 1 to {MAX_ASSUMED} {{seq, keep}} objects.")
    assumed: list[Assumed] = []
    for item in value:
        if not isinstance(item, dict):
            raise ProtocolError("field 'assume' must be a list of {seq, keep} objects.")
        earlier = check_int(item.get("seq"), "assume.seq", 0)
        if earlier >= seq or (assumed and earlier <= assumed[-1].seq):
            raise ProtocolError("assumed blocks must be earlier steps than the step itself, in ascending seq order.")
        rows = _decode_keep(item.get("keep"), max_rows)
        if not rows:
            raise ProtocolError("an assumed block keeps at least its root row; assume only blocks you keep.")
        assumed.append(Assumed(earlier, tuple(rows)))
    return tuple(assumed)


def _decode_structure(value: object, q: int) -> BlockStructure:
    if not isinstance(value, dict) or value.get("kind") not in STRUCTURE_KINDS:
        raise ProtocolError(f"field 'structure' must be an object with kind in {STRUCTURE_KINDS}.")
    kind = value["kind"]
    if kind == "chain":
        return BlockStructure.chain()
    if kind == "tree":
        parents = check_int_list(value.get("parents"), "structure.parents", -1, q - 1, q)
        if len(parents) != q or any(p >= i for i, p in enumerate(parents)):
            raise ProtocolError("tree parents must list one parent per row, each earlier than its child (or -1).")
        return BlockStructure.tree(parents)
    bits = value.get("bits")
    if not isinstance(bits, str) or len(bits) != 2 * ((q * q + 7) // 8):
        raise ProtocolError(f"matrix bits must be {(q * q + 7) // 8} bytes of hex for a {q}-row block.")
    try:
        allowed = BlockStructure("matrix", bits=bits).allowed(q)
    except ValueError as exc:
        raise ProtocolError("matrix bits are not valid hex.") from exc
    if not np.diagonal(allowed).all():
        raise ProtocolError("every row of a matrix block must see itself (set the diagonal).")
    return BlockStructure.matrix(allowed)  # canonical form: lower-case hex, zero padding


def decode_client_message(data: bytes, limits: Limits) -> ClientMessage:
    header, body = decode_frame(data)
    kind = header.get("type")
    if kind == "hello":
        layers = check_int_list(header.get("cloud_layers"), "cloud_layers", 0, 1 << 16, 2)
        if len(layers) != 2:
            raise ProtocolError("field 'cloud_layers' must be [start, end).")
        dtype = header.get("wire_dtype")
        if dtype not in limits.dtypes:
            raise ProtocolError(f"wire dtype {show(dtype)} is not accepted; use one of {', '.join(limits.dtypes)}.")
        session_id = header.get("session_id")
        if session_id is not None:
            check_str(session_id, "session_id", 128)
        version = _check_version(header)
        head_layers = header.get("head_layers")
        if head_layers is not None:
            head_layers = check_int(head_layers, "head_layers", 1, 1 << 16)
            if version < SPLIT_PIN_VERSION:
                raise ProtocolError(
                    f"field 'head_layers' needs protocol v{SPLIT_PIN_VERSION}; this hello says v{version}."
                )
        return Hello(
            fingerprint=check_str(header.get("fingerprint"), "fingerprint", 128),
            cloud_layers=(layers[0], layers[1]),
            wire_dtype=dtype,
            session_id=session_id,
            version=version,
            head_layers=head_layers,
        )
    if kind == "step":
        seq = check_int(header.get("seq"), "seq", 0)
        hidden = decode_tensor(
            header.get("tensor"), body, max_rows=limits.max_block_rows, width=limits.hidden_size, allowed=limits.dtypes
        )
        q = hidden.shape[0]
        positions = check_int_list(header.get("positions"), "positions", 0, MAX_POSITION, q)
        if len(positions) != q:
            raise ProtocolError(f"field 'positions' has {len(positions)} entries for {q} rows.")
        keep = _decode_keep(header.get("keep"), limits.max_block_rows)
        structure = _decode_structure(header.get("structure"), q)
        assume = _decode_assume(header.get("assume"), seq, limits.max_block_rows)
        resolved = check_int(header.get("resolved", 0), "resolved", 0, len(assume))
        # no larger than the step's own (padded) message: a padded reply never amplifies what the peer sent
        pad = check_int(header.get("reply_pad", 0), "reply_pad", 0, min(MAX_PAD_QUANTUM, len(data)))
        hold = check_int(header.get("hold_ms", 0), "hold_ms", 0, MAX_HOLD_MS)
        return Step(seq, tuple(keep), tuple(positions), structure, hidden, header["tensor"]["dtype"], assume, resolved,
                    pad, hold)
    if kind == "close":
        return Close()
    if kind == "probe":
        reply_bytes = check_int(header.get("reply_bytes"), "reply_bytes", 0, MAX_PROBE_BYTES)
        hold_ms = check_int(header.get("hold_ms", 0), "hold_ms", 0, MAX_HOLD_MS)
        return Probe(check_int(header.get("seq"), "seq", 0), reply_bytes, bytes(body), hold_ms)
    raise ProtocolError(f"unknown client message type {show(kind)}; expected hello, step or close (or probe).")


def decode_server_message(data: bytes, limits: Limits) -> ServerMessage:
    header, body = decode_frame(data)
    kind = header.get("type")
    if kind == "result":
        skipped = header.get("skipped", False) is True
        if skipped:
            if body:
                raise ProtocolError("a skipped result carries no tensor.")
            hidden, dtype = torch.empty(0, limits.hidden_size), None
        else:
            hidden = decode_tensor(
                header.get("tensor"), body, max_rows=limits.max_block_rows, width=limits.hidden_size,
                allowed=limits.dtypes,
            )
            dtype = header["tensor"]["dtype"]
        return Result(
            seq=check_int(header.get("seq"), "seq", 0),
            hidden=hidden,
            compute_ms=_check_float(header.get("compute_ms"), "compute_ms"),
            handle_ms=_check_float(header.get("handle_ms"), "handle_ms"),
            committed=check_int(header.get("committed"), "committed", 0),
            wire_dtype=dtype or "float16",
            skipped=skipped,
        )
    if kind == "welcome":
        return Welcome(
            session_id=check_str(header.get("session_id"), "session_id", 128),
            committed=check_int(header.get("committed"), "committed", 0),
            resumed=bool(header.get("resumed")),
            max_message_bytes=check_int(header.get("max_message_bytes"), "max_message_bytes", 1024),
            max_block_rows=check_int(header.get("max_block_rows"), "max_block_rows", 1),
            next_seq=check_int(header.get("next_seq"), "next_seq", 0),
            version=_check_version(header),
            max_in_flight=check_int(header.get("max_in_flight", 1), "max_in_flight", 1, MAX_ASSUMED + 1),
        )
    if kind == "error":
        seq = header.get("seq")
        return Error(
            code=check_str(header.get("code"), "code", 64),
            message=check_str(header.get("message"), "message", 4096),
            seq=None if seq is None else check_int(seq, "seq", 0),
        )
    if kind == "probe_reply":
        received = check_int(header.get("received"), "received", 0)
        return ProbeReply(check_int(header.get("seq"), "seq", 0), received, bytes(body))
    raise ProtocolError(
        f"unknown server message type {show(kind)}; expected welcome, result or error (or probe_reply)."
    )
