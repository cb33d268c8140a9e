"""The 4-bit blocks of a GGUF file, as they are stored, keyed by the HF state-dict names they stand for.

transformers loads a GGUF by dequantizing every tensor to float; `prepare --weights int4` would then
quantize those floats again and land on other values. This module reads the file's own Q4_0/Q4_1 blocks
instead (32 weights each: an fp16 scale d, for Q4_1 an fp16 minimum m, and 32 four-bit values q; the
weight is d * q + m, Q4_0's being d * (q - 8)), so an int4 shard keeps exactly the GGUF's integers and
scales. Each tensor's row order is matched against the float tensor transformers produced (it reorders
the query and key rows of llama-family models): a tensor whose dequantized blocks do not equal that
tensor bit for bit is left out, and prepare quantizes it from the float instead. Other block types
(Q5_0, Q8_0, the K-quants) are only named (`tensor_types`, what `prepare --weights auto` chooses by): no
kernel here multiplies by them as stored, so prepare takes their values from transformers' floats.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("splitinfer.model")

BLOCK = 32  # weights a block


def _decode(kind: str, raw: np.ndarray, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """raw uint8 [rows, bytes] -> q uint8 [rows, K], d and m float32 [rows, K / 32] (w = d * q + m)."""
    width = 18 if kind == "Q4_0" else 20
    blocks = torch.from_numpy(np.array(raw, copy=True)).reshape(rows, -1, width)
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    if kind == "Q4_0":
        m, nibbles = -8 * d, blocks[..., 2:]
    else:
        m, nibbles = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].float(), blocks[..., 4:]
    q = torch.cat((nibbles & 0xF, nibbles >> 4), dim=2).reshape(rows, -1)
    return q, d, m


def _dequantize(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    rows = q.shape[0]
    return (d[..., None] * q.reshape(rows, -1, BLOCK).float() + m[..., None]).reshape(rows, -1)


def _row_orders(rows: int, config) -> list[torch.Tensor]:
    """Row orders to try: as stored, and the query/key order llama.cpp's converter permutes into."""
    orders = [torch.arange(rows)]
    for heads in {config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads}:
        if rows % (2 * heads) == 0:
            orders.append(torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows))
    return orders


def _stored(path: str | Path, state: dict[str, torch.Tensor], config):
    """(HF key, float tensor, the GGUF's tensor) for every 2-D weight of `state` the GGUF at `path` stores."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch_name = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}.get(arch_name)
    if arch is None:
        return
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    by_name = {t.name: t for t in reader.tensors}
    for key, tensor in state.items():
        if not key.endswith(".weight") or tensor.dim() != 2:
            continue
        gguf_name = names.get_name(key[: -len(".weight")])
        stored = by_name.get(f"{gguf_name}.weight") if gguf_name else None
        if stored is not None:
            yield key, tensor, stored


def tensor_types(path: str | Path, state: dict[str, torch.Tensor], config) -> dict[str, str]:
    """{HF key: GGML type name ('Q4_K', 'Q8_0', 'F16', ...)} of every 2-D weight of `state` in the GGUF at `path`."""
    return {key: stored.tensor_type.name for key, _, stored in _stored(path, state, config)}


def read_blocks(path: str | Path, state: dict[str, torch.Tensor], config) -> dict[str, tuple]:
    """{HF key: (q, d, m)} for every Q4_0/Q4_1 tensor of the GGUF at `path` whose blocks match `state`
    (the float tensors transformers loaded from the same file) bit for bit, in HF row order."""
    blocks = {}
    for key, tensor, stored in _stored(path, state, config):
        if stored.tensor_type.name not in ("Q4_0", "Q4_1"):
            continue
        found = _match(stored.tensor_type.name, stored.data, tensor, config)
        if found is None:
            log.warning("%s: the GGUF's 4-bit blocks do not match the loaded weight; int4 quantizes it again", key)
        else:
            blocks[key] = found
    return blocks


def _match(kind: str, raw: np.ndarray, tensor: torch.Tensor, config) -> tuple | None:
    q, d, m = _decode(kind, raw, tensor.shape[0])
    if q.shape != tensor.shape:
        return None
    values = _dequantize(q, d, m)
    for order in _row_orders(tensor.shape[0], config):
        if torch.equal(values[order], tensor.float()):
            return q[order].contiguous(), d[order].contiguous(), m[order].contiguous()
    return None
