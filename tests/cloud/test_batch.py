"""Batched middle-layer passes equal lone passes: every session's rows and cache, for three model families."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitinfer.cloud.batch import Block, forward_blocks
from splitinfer.masks import BlockStructure, chain_allowed
from splitinfer.model.shards import load_cloud

from tiny import prepare_tiny

# Tight float32 tolerance: batching changes GEMM shapes (and so summation order), nothing else.
ATOL = 2e-5

TREE = (-1, 0, 0, 1, 2, 3)  # depths 0 1 1 2 2 3; the path to row 5 is rows 0, 1, 3, 5
TREE_PATH = [0, 1, 3, 5]


def jacobi_allowed(q: int) -> np.ndarray:
    """A non-tree block: each row sees itself and the rows two and more back (not a chain, not a tree)."""
    allowed = np.eye(q, dtype=bool)
    for i in range(q):
        allowed[i, : max(0, i - 1)] = True
    return allowed


def block_script(session: int, rounds: int):
    """Per round: (structure, q, rows to keep afterwards). Sessions get different shapes in the same round."""
    menu = [
        (BlockStructure.chain(), 1, [0]),
        (BlockStructure.tree(TREE), len(TREE), TREE_PATH),
        (BlockStructure.matrix(jacobi_allowed(5)), 5, [0, 1, 2]),
        (BlockStructure.chain(), 7, [0, 1, 2, 3, 4, 5, 6]),
        (BlockStructure.chain(), 4, []),  # everything rejected
        (BlockStructure.tree((-1, 0, 1)), 3, [0, 1]),
    ]
    return [menu[(session * 2 + r) % len(menu)] for r in range(rounds)]


def positions_for(structure: BlockStructure, q: int, committed: int) -> torch.Tensor:
    depths = structure.depths(q)
    if depths is None:
        return torch.arange(committed, committed + q)
    return torch.tensor([committed + d for d in depths])


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def stack(request, tmp_path_factory):
    _, shards = prepare_tiny(tmp_path_factory.mktemp(request.param), request.param, 1, 1)
    return load_cloud(shards / "cloud").stack


def prefilled(stack, length: int, seed: int):
    cache = stack.new_cache()
    if length:
        hidden = torch.randn(length, 64, generator=torch.Generator().manual_seed(seed))
        hidden = hidden.to(next(stack.parameters()).dtype)
        stack(hidden[None], torch.arange(length), chain_allowed(length), cache)
        cache.commit_all()
    return cache


def test_batched_sessions_match_lone_sessions(stack):
    """Six sessions of different lengths (one empty, two past Mistral's window of 12) step together for
    six rounds with chain, tree and matrix blocks and lazy keep lists; each matches its lone twin."""
    lengths = [0, 3, 11, 17, 30, 5]
    lone = [prefilled(stack, n, seed=i) for i, n in enumerate(lengths)]
    batched = [prefilled(stack, n, seed=i) for i, n in enumerate(lengths)]
    scripts = [block_script(i, 6) for i in range(len(lengths))]
    gen = torch.Generator().manual_seed(7)
    for r in range(6):
        blocks, expected = [], []
        for i in range(len(lengths)):
            structure, q, _ = scripts[i][r]
            hidden = torch.randn(q, 64, generator=gen)
            positions = positions_for(structure, q, lone[i].length)
            allowed = structure.allowed(q)
            expected.append(stack(hidden[None], positions, allowed, lone[i])[0])
            blocks.append(Block(hidden, positions, allowed, batched[i]))
        outs = forward_blocks(stack, blocks)
        for i, (got, want) in enumerate(zip(outs, expected)):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=f"session {i}, round {r}")
            assert batched[i].pending == lone[i].pending == want.shape[0]
            keep = scripts[i][r][2]
            lone[i].keep(keep)
            batched[i].keep(keep)
    for i in range(len(lengths)):
        assert batched[i].length == lone[i].length
        n = lone[i].length
        for layer in range(len(stack.layers)):
            for got, want in ((batched[i]._keys, lone[i]._keys), (batched[i]._values, lone[i]._values)):
                torch.testing.assert_close(got[layer][:, :, :n], want[layer][:, :, :n], atol=ATOL, rtol=0)


def test_mask_separates_sessions(stack):
    """Changing one session's input must not move another session's output by a single bit."""
    caches = [prefilled(stack, n, seed=n) for n in (4, 9)]
    copies = [prefilled(stack, n, seed=n) for n in (4, 9)]
    a = torch.randn(1, 64)
    first = forward_blocks(stack, [Block(a, torch.tensor([4]), chain_allowed(1), caches[0]),
                                   Block(torch.randn(1, 64), torch.tensor([9]), chain_allowed(1), caches[1])])
    second = forward_blocks(stack, [Block(a, torch.tensor([4]), chain_allowed(1), copies[0]),
                                    Block(torch.randn(1, 64) * 3, torch.tensor([9]), chain_allowed(1), copies[1])])
    assert torch.equal(first[0], second[0])
    assert not torch.allclose(first[1], second[1])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_batches_agree_within_rounding(tmp_path, dtype):
    """The GPU dtypes go through the same path (masks, cache, workspace in the compute dtype); batched
    rows agree with lone rows within that dtype's rounding (measured: 1 bf16 ulp at the largest value)."""
    _, shards = prepare_tiny(tmp_path, "mistral", 1, 1)
    stack = load_cloud(shards / "cloud", dtype=dtype).stack
    torch_dtype = getattr(torch, dtype)
    lone = [prefilled(stack, n, seed=n) for n in (6, 20)]
    batched = [prefilled(stack, n, seed=n) for n in (6, 20)]
    hidden = [torch.randn(q, 64, generator=torch.Generator().manual_seed(q)).to(torch_dtype) for q in (1, 6)]
    blocks = [Block(h, torch.arange(c.length, c.length + h.shape[0]), chain_allowed(h.shape[0]), c)
              for h, c in zip(hidden, batched)]
    outs = forward_blocks(stack, blocks)
    for h, cache, got in zip(hidden, lone, outs):
        positions = torch.arange(cache.length, cache.length + h.shape[0])
        want = stack(h[None], positions, chain_allowed(h.shape[0]), cache)[0]
        assert got.dtype == torch_dtype and torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), want.float(), atol=0.01 * want.float().abs().max().item(), rtol=0)
