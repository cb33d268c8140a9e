"""Block structures and the attention masks rebuilt from them (pure functions, no model, no network).

A block is the set of q rows one request runs: a prefill chunk, one sequential token, a speculative
tree or a Jacobi window. On the wire it travels as its structure only (docs/design.md, "Blocks, masks and the KV cache"):

- `chain`:  row i sees block rows 0..i (prefill chunks, sequential steps, linear drafts);
- `tree`:   `parents[i]` is the block index of row i's parent (-1 for a root); a row sees its ancestors
            and itself;
- `matrix`: an explicit q x q boolean matrix for blocks that are not trees.

Every row also sees all committed cache rows (positions 0..L-1), limited by a sliding window where the
layer has one. Masks are additive floats (0 or the dtype's minimum) because both the eager and the sdpa
attention paths of HF transformers accept that form; never rely on `is_causal` with a populated cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def chain_allowed(q: int) -> np.ndarray:
    """[q, q] bool: lower triangular."""
    return np.tril(np.ones((q, q), dtype=bool))


def tree_allowed(parents: Sequence[int]) -> np.ndarray:
    """[q, q] bool: row i sees j iff j is i or an ancestor of i. Requires parents[i] < i."""
    q = len(parents)
    allowed = np.zeros((q, q), dtype=bool)
    for i, p in enumerate(parents):
        assert -1 <= p < i, (i, p)
        if p >= 0:
            allowed[i] = allowed[p]
        allowed[i, i] = True
    return allowed


def tree_depths(parents: Sequence[int]) -> list[int]:
    depths: list[int] = []
    for p in parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


def pack_bits(allowed: np.ndarray) -> str:
    """Row-major bit packing of a boolean matrix, as hex (compact JSON)."""
    return np.packbits(allowed.astype(bool).reshape(-1)).tobytes().hex()


def unpack_bits(hex_bits: str, q: int) -> np.ndarray:
    raw = np.frombuffer(bytes.fromhex(hex_bits), dtype=np.uint8)
    return np.unpackbits(raw)[: q * q].reshape(q, q).astype(bool)


def attention_mask(
    committed: int,
    positions: torch.Tensor,
    allowed: np.ndarray,
    dtype: torch.dtype,
    window: int | None = None,
) -> torch.Tensor:
    """Additive mask [1, 1, q, committed + q] for a block at `positions` over `committed` cache rows.

    positions: [q] long, the block rows' absolute positions. allowed: [q, q] bool block structure.
    window: sliding-window size of the layer (a query at p sees keys at positions > p - window).
    """
    q = positions.shape[0]
    assert allowed.shape == (q, q), (allowed.shape, q)
    device = positions.device
    visible = torch.ones((q, committed + q), dtype=torch.bool, device=device)
    visible[:, committed:] = torch.from_numpy(np.ascontiguousarray(allowed)).to(device)
    if window is not None:
        key_positions = torch.cat([torch.arange(committed, device=device), positions])
        visible &= key_positions[None, :] > positions[:, None] - window
    mask = torch.zeros((1, 1, q, committed + q), dtype=dtype, device=device)
    mask.masked_fill_(~visible[None, None], torch.finfo(dtype).min)
    return mask


STRUCTURE_KINDS = ("chain", "tree", "matrix")


class BlockStructure:
    """The in-block visibility of one block, in the compact form that travels on the wire."""

    __slots__ = ("kind", "parents", "bits")

    def __init__(self, kind: str, parents: tuple[int, ...] | None = None, bits: str | None = None):
        self.kind, self.parents, self.bits = kind, parents, bits

    @classmethod
    def chain(cls) -> "BlockStructure":
        return cls("chain")

    @classmethod
    def tree(cls, parents: Sequence[int]) -> "BlockStructure":
        return cls("tree", parents=tuple(parents))

    @classmethod
    def matrix(cls, allowed: np.ndarray) -> "BlockStructure":
        return cls("matrix", bits=pack_bits(allowed))

    def allowed(self, q: int) -> np.ndarray:
        if self.kind == "chain":
            return chain_allowed(q)
        if self.kind == "tree":
            return tree_allowed(self.parents)
        return unpack_bits(self.bits, q)

    def depths(self, q: int) -> list[int] | None:
        """Depth of each row for chains and trees (positions are committed + depth); None for matrices."""
        if self.kind == "chain":
            return list(range(q))
        if self.kind == "tree":
            return tree_depths(self.parents)
        return None

    def as_dict(self) -> dict:
        if self.kind == "tree":
            return {"kind": "tree", "parents": list(self.parents)}
        if self.kind == "matrix":
            return {"kind": "matrix", "bits": self.bits}
        return {"kind": "chain"}

    def __eq__(self, other):
        return isinstance(other, BlockStructure) and self.as_dict() == other.as_dict()

    def __repr__(self):
        return f"BlockStructure({self.as_dict()})"
