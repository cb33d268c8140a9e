"""Framing and the tensor codec (sans-I/O: bytes in, values out; never touches a socket).

One message is `[4-byte big-endian header length][UTF-8 JSON header][raw tensor bytes]`. A tensor is
raw little-endian float16, bfloat16 or float32, described in the header by dtype and shape; a padded
message (wire/padding.py) ends in zero bytes its header counts. Nothing read from the network is unpickled, `torch.load`ed or base64-decoded.
"""

from __future__ import annotations

import json
import math
import struct
import sys

import numpy as np
import torch

from ..errors import MessageTooLarge, ProtocolError
from .dtypes import DTYPE_NAMES

MAX_HEADER_BYTES = 64 * 1024
WIRE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
assert tuple(WIRE_DTYPES) == DTYPE_NAMES, "one list of wire dtypes, in the order the limits announce them"
# float16 halves float32's bytes, but Gemma 3's residual stream grows past float16's range (65504) within a
# few layers, so `prepare` records bfloat16 (float32's exponent range) for it; clients use what the shard
# records unless told otherwise.
BFLOAT16_WIRE_MODELS = ("gemma3", "gemma3_text")
DEFAULT_WIRE_DTYPE = "float16"  # shards whose manifest records none, and links and plans told none
_LENGTH = struct.Struct(">I")

# The codec writes the host's bytes as they are; every platform torch supports in practice is
# little-endian, and a big-endian host would need byte swaps that this module does not do.
assert sys.byteorder == "little", "splitinfer's wire codec requires a little-endian host"


def encode_frame(header: dict, body: bytes = b"") -> bytes:
    raw = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    if len(raw) > MAX_HEADER_BYTES:
        raise MessageTooLarge(f"message header is {len(raw)} bytes; the limit is {MAX_HEADER_BYTES}.")
    return b"".join((_LENGTH.pack(len(raw)), raw, body))


def decode_frame(data: bytes) -> tuple[dict, memoryview]:
    """Split a message into its JSON header (a dict) and its body (a view, not a copy), padding removed."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError("expected a binary message; text messages are not part of the protocol.")
    view = memoryview(data)
    if len(view) < 4:
        raise ProtocolError(f"message is {len(view)} bytes, shorter than its 4-byte length prefix.")
    (length,) = _LENGTH.unpack(view[:4])
    if length > MAX_HEADER_BYTES or 4 + length > len(view):
        raise ProtocolError(f"header length {length} is impossible for a {len(view)}-byte message.")
    try:
        header = json.loads(bytes(view[4 : 4 + length]).decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise ProtocolError(f"message header is not valid UTF-8 JSON: {show(exc)}") from exc
    if not isinstance(header, dict):
        raise ProtocolError("message header must be a JSON object.")
    end = len(view)
    if "pad" in header:  # zero bytes after the body that hide its size (wire/padding.py): never read
        end -= check_int(header.pop("pad"), "pad", 0, len(view) - 4 - length)
    return header, view[4 + length : end]


def _reject_constant(name: str):
    raise ValueError(f"{name} is not allowed in a header")


# Integer views make the finiteness check one vectorised numpy op for every wire dtype (bfloat16
# included, which numpy cannot represent): a value is NaN or infinite iff its exponent bits are all ones.
_BITS = {
    "float16": (np.uint16, 0x7C00),
    "bfloat16": (np.uint16, 0x7F80),
    "float32": (np.uint32, 0x7F800000),
}


def _all_finite(bits: np.ndarray, dtype: str) -> bool:
    mask = _BITS[dtype][1]
    return not bool(np.any((bits & mask) == mask))


def default_wire_dtype(model_type: str) -> str:
    """The wire dtype `prepare` records for a model family (its config's model_type)."""
    return "bfloat16" if model_type in BFLOAT16_WIRE_MODELS else "float16"


def wire_dtype_of(manifest: dict) -> str:
    """The wire dtype a shard's manifest records; float16 for shards prepared before manifests recorded one."""
    return manifest.get("wire_dtype", DEFAULT_WIRE_DTYPE)


def encode_tensor(tensor: torch.Tensor, dtype: str) -> tuple[dict, bytes]:
    """Cast to the wire dtype and return (spec, raw bytes). Rejects values the wire dtype cannot hold."""
    if dtype not in WIRE_DTYPES:
        raise ProtocolError(f"wire dtype must be one of {', '.join(WIRE_DTYPES)}, not {dtype!r}.")
    wire = tensor.detach().to("cpu", WIRE_DTYPES[dtype]).contiguous()
    int_type = torch.int16 if wire.element_size() == 2 else torch.int32
    bits = wire.view(int_type).numpy().view(_BITS[dtype][0])
    if not _all_finite(bits, dtype):
        # float16 overflows above 65504; some models have activations that large.
        raise ProtocolError(f"hidden states are not finite in {dtype}; use a bfloat16 or float32 wire (--wire-dtype).")
    return {"dtype": dtype, "shape": list(wire.shape)}, bits.tobytes()


def decode_tensor(spec: object, body: memoryview, *, max_rows: int, width: int, allowed: tuple[str, ...]) -> torch.Tensor:
    """Validate a tensor spec against the body and the model, and return a [rows, width] tensor.

    Checks dtype, rank, shape (rows in 1..max_rows, columns == width), byte count and finiteness, in
    that order, before any value reaches a model.
    """
    if not isinstance(spec, dict):
        raise ProtocolError("field 'tensor' must be an object with 'dtype' and 'shape'.")
    dtype, shape = spec.get("dtype"), spec.get("shape")
    if dtype not in allowed:
        raise ProtocolError(f"tensor dtype {show(dtype)} is not accepted here; use one of {', '.join(allowed)}.")
    if not (isinstance(shape, list) and len(shape) == 2 and all(_is_int(s) for s in shape)):
        raise ProtocolError("tensor shape must be a list of two integers [rows, hidden_size].")
    rows, cols = shape
    if cols != width:
        raise ProtocolError(f"tensor has {cols} columns but the model's hidden size is {width}.")
    if not 1 <= rows <= max_rows:
        raise ProtocolError(f"tensor has {rows} rows; between 1 and {max_rows} are accepted per message.")
    torch_dtype = WIRE_DTYPES[dtype]
    expected = rows * cols * torch_dtype.itemsize
    if len(body) != expected:
        raise ProtocolError(f"tensor body is {len(body)} bytes; shape {shape} in {dtype} needs {expected}.")
    # A copy: it detaches the tensor from the frame's buffer and makes it writable.
    bits = np.frombuffer(body, dtype=_BITS[dtype][0]).copy()
    if not _all_finite(bits, dtype):
        raise ProtocolError("tensor contains NaN or infinity.")
    signed = np.int16 if torch_dtype.itemsize == 2 else np.int32
    return torch.from_numpy(bits.view(signed)).view(torch_dtype).reshape(rows, cols)


def show(value: object, limit: int = 80) -> str:
    """A peer's value quoted in an error message, cut short: errors must not echo unbounded input."""
    text = repr(value) if not isinstance(value, BaseException) else str(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(value: object, name: str, low: int, high: float = math.inf) -> int:
    if not _is_int(value) or not low <= value <= high:
        raise ProtocolError(f"field {name!r} must be an integer in [{low}, {high}], got {show(value)}.")
    return value


def check_int_list(value: object, name: str, low: int, high: float, max_len: int) -> list[int]:
    if not isinstance(value, list) or len(value) > max_len:
        raise ProtocolError(f"field {name!r} must be a list of at most {max_len} integers.")
    for item in value:
        check_int(item, name, low, high)
    return value


def check_str(value: object, name: str, max_len: int = 256) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= max_len:
        raise ProtocolError(f"field {name!r} must be a non-empty string of at most {max_len} characters.")
    return value
