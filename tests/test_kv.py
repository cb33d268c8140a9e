"""The KV cache: append after committed rows, keep a subset of the pending block, grow, truncate."""

from __future__ import annotations

import pytest
import torch

from splitinfer.kv import KVCache

LAYERS, HEADS, DIM = 3, 2, 4


def _block(q: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (key, value) pairs [1, HEADS, q, DIM], all different."""
    g = torch.Generator().manual_seed(seed)
    shape = (1, HEADS, q, DIM)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(LAYERS)]


def _run(cache: KVCache, block) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One forward pass: every layer calls update once; returns clones of what the layers saw."""
    out = []
    for layer, (k, v) in enumerate(block):
        keys, values = cache.update(k, v, layer, {"cache_position": None})  # HF passes extra arguments
        out.append((keys.clone(), values.clone()))
    return out


def _rows(block, rows):
    return [(k[:, :, rows], v[:, :, rows]) for k, v in block]


def _cat(*parts):
    return [
        (torch.cat([p[layer][0] for p in parts], dim=2), torch.cat([p[layer][1] for p in parts], dim=2))
        for layer in range(LAYERS)
    ]


def _assert_same(seen, expected):
    assert len(seen) == len(expected) == LAYERS
    for (k, v), (ek, ev) in zip(seen, expected):
        assert k.shape == ek.shape and torch.equal(k, ek)
        assert v.shape == ev.shape and torch.equal(v, ev)


def test_update_appends_after_committed_rows():
    cache = KVCache(LAYERS, initial_capacity=16)
    first = _block(3, seed=0)
    _assert_same(_run(cache, first), first)
    assert (cache.length, cache.pending) == (0, 3)
    cache.commit_all()
    assert (cache.length, cache.pending) == (3, 0)

    second = _block(2, seed=1)
    seen = _run(cache, second)  # [:L+q] = committed rows then the new block
    _assert_same(seen, _cat(first, second))
    assert (cache.length, cache.pending) == (3, 2)


def test_update_returns_only_used_rows_not_capacity():
    cache = KVCache(LAYERS, initial_capacity=64)
    keys, values = cache.update(*_block(5, seed=0)[0], 0)
    assert keys.shape == values.shape == (1, HEADS, 5, DIM)


def test_growing_beyond_capacity_keeps_committed_rows():
    cache = KVCache(LAYERS, initial_capacity=4)  # the first allocation is at least 16 rows
    first = _block(10, seed=0)
    _run(cache, first)
    cache.commit_all()
    nbytes_small = cache.nbytes()
    # 2 buffers (k, v) x layers x [1, HEADS, 16, DIM] float32
    assert nbytes_small == 2 * LAYERS * HEADS * 16 * DIM * 4

    second = _block(10, seed=1)  # 20 rows needed: doubles to 32
    _assert_same(_run(cache, second), _cat(first, second))
    assert cache.nbytes() == 2 * LAYERS * HEADS * 32 * DIM * 4
    cache.commit_all()

    third = _block(50, seed=2)  # 70 rows needed: 32 -> 64 -> 128
    _assert_same(_run(cache, third), _cat(first, second, third))
    assert cache.nbytes() == 2 * LAYERS * HEADS * 128 * DIM * 4
    assert cache.length == 20 and cache.pending == 50


def test_keep_non_prefix_moves_exactly_those_rows():
    cache = KVCache(LAYERS, initial_capacity=16)
    committed = _block(3, seed=0)
    _run(cache, committed)
    cache.commit_all()

    draft = _block(4, seed=1)
    _run(cache, draft)
    cache.keep([0, 2, 3])
    assert (cache.length, cache.pending) == (6, 0)

    nxt = _block(1, seed=2)
    seen = _run(cache, nxt)
    _assert_same(seen, _cat(committed, _rows(draft, [0, 2, 3]), nxt))


@pytest.mark.parametrize("rows", [[1], [3], [1, 3], [0, 1, 2, 3], [0, 1]])
def test_keep_any_ascending_selection(rows):
    cache = KVCache(LAYERS, initial_capacity=16)
    committed = _block(2, seed=0)
    _run(cache, committed)
    cache.commit_all()
    draft = _block(4, seed=1)
    _run(cache, draft)
    cache.keep(rows)
    assert cache.length == 2 + len(rows)
    nxt = _block(2, seed=2)
    _assert_same(_run(cache, nxt), _cat(committed, _rows(draft, rows), nxt))


def test_keep_nothing_drops_the_block():
    cache = KVCache(LAYERS, initial_capacity=16)
    committed = _block(3, seed=0)
    _run(cache, committed)
    cache.commit_all()
    _run(cache, _block(4, seed=1))
    cache.keep([])
    assert (cache.length, cache.pending) == (3, 0)
    nxt = _block(2, seed=2)
    _assert_same(_run(cache, nxt), _cat(committed, nxt))


def test_keep_rejects_rows_outside_the_pending_block():
    cache = KVCache(LAYERS, initial_capacity=16)
    _run(cache, _block(2, seed=0))
    with pytest.raises(AssertionError):
        cache.keep([2])
    with pytest.raises(AssertionError):
        cache.keep([1, 0])


def test_commit_all_commits_the_pending_block_in_order():
    cache = KVCache(LAYERS, initial_capacity=16)
    first = _block(4, seed=0)
    _run(cache, first)
    cache.commit_all()
    assert (cache.length, cache.pending) == (4, 0)
    cache.commit_all()  # nothing pending: no change
    assert cache.length == 4
    nxt = _block(1, seed=1)
    _assert_same(_run(cache, nxt), _cat(first, nxt))


def test_truncate_forgets_later_rows_and_the_pending_block():
    cache = KVCache(LAYERS, initial_capacity=16)
    first = _block(5, seed=0)
    _run(cache, first)
    cache.commit_all()
    _run(cache, _block(3, seed=1))  # pending, then forgotten
    cache.truncate(2)
    assert (cache.length, cache.pending) == (2, 0)
    nxt = _block(3, seed=2)
    _assert_same(_run(cache, nxt), _cat(_rows(first, [0, 1]), nxt))
    with pytest.raises(AssertionError):
        cache.truncate(6)


def test_nbytes():
    cache = KVCache(LAYERS, initial_capacity=16)
    assert cache.nbytes() == 0
    cache.update(*_block(1, seed=0)[0], 0)  # one layer allocated
    assert cache.nbytes() == 2 * HEADS * 16 * DIM * 4 > 0
