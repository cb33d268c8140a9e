"""Block structures and the additive attention masks rebuilt from them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitinfer.masks import (
    BlockStructure,
    attention_mask,
    chain_allowed,
    pack_bits,
    tree_allowed,
    tree_depths,
    unpack_bits,
)

T, F = True, False


def _visible(mask: torch.Tensor) -> list[list[bool]]:
    """The [q, L+q] visibility of an additive mask, checking it holds only 0 and the dtype's minimum."""
    assert mask.shape[:2] == (1, 1)
    low = torch.finfo(mask.dtype).min
    assert bool(((mask == 0) | (mask == low)).all())
    return (mask[0, 0] == 0).tolist()


def test_chain_allowed_is_lower_triangular():
    assert chain_allowed(3).tolist() == [[T, F, F], [T, T, F], [T, T, T]]
    assert chain_allowed(1).tolist() == [[T]]
    assert chain_allowed(3).dtype == bool


def test_tree_allowed_hand_drawn_tree():
    #      0
    #     / \
    #    1   2
    #    |   |
    #    3   4
    parents = [-1, 0, 0, 1, 2]
    assert tree_allowed(parents).tolist() == [
        [T, F, F, F, F],
        [T, T, F, F, F],
        [T, F, T, F, F],
        [T, T, F, T, F],
        [T, F, T, F, T],
    ]
    assert tree_depths(parents) == [0, 1, 1, 2, 2]


def test_tree_allowed_forest_and_chain():
    # Two roots: rows of one tree never see the other.
    assert tree_allowed([-1, -1, 0, 1]).tolist() == [
        [T, F, F, F],
        [F, T, F, F],
        [T, F, T, F],
        [F, T, F, T],
    ]
    assert tree_depths([-1, -1, 0, 1]) == [0, 0, 1, 1]
    # A tree that is a path is a chain.
    assert np.array_equal(tree_allowed([-1, 0, 1, 2]), chain_allowed(4))
    assert tree_depths([-1, 0, 1, 2]) == [0, 1, 2, 3]


def test_pack_bits_is_row_major_hex():
    # Rows [1,0],[1,1] -> bits 1011, padded to a byte: 0xb0.
    assert pack_bits(np.array([[T, F], [T, T]])) == "b0"
    # 3x3 chain: 100 110 111 -> 10011011 1(0000000) -> 9b 80.
    assert pack_bits(chain_allowed(3)) == "9b80"
    assert unpack_bits("9b80", 3).tolist() == chain_allowed(3).tolist()


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 20).flatmap(lambda q: st.lists(st.booleans(), min_size=q * q, max_size=q * q)))
def test_pack_unpack_round_trip(flat):
    q = int(round(len(flat) ** 0.5))
    allowed = np.array(flat, dtype=bool).reshape(q, q)
    hex_bits = pack_bits(allowed)
    assert len(hex_bits) == 2 * ((q * q + 7) // 8)
    restored = unpack_bits(hex_bits, q)
    assert restored.dtype == bool and np.array_equal(restored, allowed)
    assert np.array_equal(BlockStructure.matrix(allowed).allowed(q), allowed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_attention_mask_chain_over_committed_rows(dtype):
    mask = attention_mask(3, torch.tensor([3, 4]), chain_allowed(2), dtype)
    assert mask.shape == (1, 1, 2, 5) and mask.dtype == dtype
    low = torch.finfo(dtype).min
    expected = torch.tensor([[0, 0, 0, 0, low], [0, 0, 0, 0, 0]], dtype=dtype)
    assert torch.equal(mask[0, 0], expected)


def test_attention_mask_block_part_matches_a_tree():
    parents = [-1, 0, 0, 1, 2]
    allowed = tree_allowed(parents)
    mask = attention_mask(4, torch.tensor([4, 5, 5, 6, 6]), allowed, torch.float32)
    assert mask.shape == (1, 1, 5, 9)
    visible = np.array(_visible(mask))
    assert visible[:, :4].all()  # every committed row is visible to every block row
    assert np.array_equal(visible[:, 4:], allowed)


def test_attention_mask_with_no_committed_rows():
    allowed = np.array([[T, F, F], [F, T, F], [T, T, T]])  # a matrix structure
    mask = attention_mask(0, torch.tensor([0, 0, 1]), allowed, torch.float32)
    assert mask.shape == (1, 1, 3, 3)
    assert _visible(mask) == allowed.tolist()


def test_attention_mask_sliding_window_by_hand():
    # Committed keys at positions 0..3, block rows at positions 4 and 5 (a chain), window 3:
    # a query at p sees keys at positions > p - 3.
    #   p=4 sees positions 2, 3, 4          (4 and 5's key is later in the chain)
    #   p=5 sees positions 3, 4, 5
    mask = attention_mask(4, torch.tensor([4, 5]), chain_allowed(2), torch.float32, window=3)
    assert _visible(mask) == [
        [F, F, T, T, T, F],
        [F, F, F, T, T, T],
    ]


def test_attention_mask_sliding_window_uses_block_positions_for_block_keys():
    # A tree whose siblings share position 6. Window 2: p=5 sees positions 4 and 5; p=6 sees 5 and 6, so the
    # committed row at position 4 is hidden from the siblings while their root (position 5) stays visible.
    parents = [-1, 0, 0]
    mask = attention_mask(5, torch.tensor([5, 6, 6]), tree_allowed(parents), torch.float32, window=2)
    assert _visible(mask) == [
        [F, F, F, F, T, T, F, F],
        [F, F, F, F, F, T, T, F],
        [F, F, F, F, F, T, F, T],
    ]


def test_attention_mask_window_larger_than_context_changes_nothing():
    args = (4, torch.tensor([4, 5]), chain_allowed(2), torch.float32)
    assert torch.equal(attention_mask(*args, window=100), attention_mask(*args))


def test_block_structure_as_dict_and_equality():
    chain = BlockStructure.chain()
    tree = BlockStructure.tree([-1, 0, 0])
    matrix = BlockStructure.matrix(np.array([[T, F], [T, T]]))
    assert chain.as_dict() == {"kind": "chain"}
    assert tree.as_dict() == {"kind": "tree", "parents": [-1, 0, 0]}
    assert matrix.as_dict() == {"kind": "matrix", "bits": "b0"}
    assert tree.parents == (-1, 0, 0)  # stored as a tuple, whatever sequence came in

    assert chain == BlockStructure.chain()
    assert tree == BlockStructure.tree((-1, 0, 0))
    assert tree != BlockStructure.tree([-1, 0, 1])
    assert matrix == BlockStructure("matrix", bits="b0")
    assert chain != tree and tree != matrix and chain != matrix
    assert chain != {"kind": "chain"}  # only structures compare equal to structures


def test_block_structure_allowed_per_kind():
    assert np.array_equal(BlockStructure.chain().allowed(3), chain_allowed(3))
    assert np.array_equal(BlockStructure.tree([-1, 0, 0]).allowed(3), tree_allowed([-1, 0, 0]))
    allowed = np.array([[T, T], [F, T]])
    assert np.array_equal(BlockStructure.matrix(allowed).allowed(2), allowed)


def test_block_structure_depths():
    assert BlockStructure.chain().depths(4) == [0, 1, 2, 3]
    assert BlockStructure.tree([-1, 0, 0, 1, 2]).depths(5) == [0, 1, 1, 2, 2]
    assert BlockStructure.matrix(chain_allowed(3)).depths(3) is None
