"""model/attention.py: grouped queries stacked as rows compute transformers' sdpa result, and loaded shards use it."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from splitinfer import kernels
from splitinfer.model import attention
from splitinfer.model.shards import load_cloud, load_local
from tiny import prepare_tiny


class Attn(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 2)])
def test_grouped_sdpa_matches_transformers_sdpa(rows, heads, kv_heads):
    gen = torch.Generator().manual_seed(rows * heads)
    keys = 7 + rows
    query = torch.randn(1, heads, rows, 16, generator=gen)
    key, value = (torch.randn(1, kv_heads, keys, 16, generator=gen) for _ in range(2))
    allowed = torch.rand(1, 1, rows, keys, generator=gen) > 0.3
    allowed[..., 0] = True  # every row sees a key
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    module = Attn(heads // kv_heads)
    ours, _ = attention.grouped_sdpa(module, query, key, value, mask, scaling=0.25)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    assert ours.shape == (1, rows, heads, 16) and ours.is_contiguous()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_loaded_shards_attend_through_grouped_sdpa(tmp_path):
    _, shards = prepare_tiny(tmp_path, "llama", 1, 1)
    layers = [*load_local(shards / "local").head.layers, *load_cloud(shards / "cloud").stack.layers]
    assert layers and all(layer.self_attn.config._attn_implementation == attention.NAME for layer in layers)


def _tree_mask(parents: list[int], cached: int, window: int | None) -> torch.Tensor:
    from splitinfer.masks import attention_mask, tree_allowed, tree_depths

    positions = torch.tensor([cached + d for d in tree_depths(parents)])
    return attention_mask(cached, positions, tree_allowed(parents), torch.float32, window=window)


def _pytorch_rows(monkeypatch) -> None:
    """Exact-rows attention through PyTorch's SDPA a row, as where kernels/rows_attention.cpp does not run."""
    monkeypatch.setattr(attention, "_native_fits", lambda *args: False)


needs_native = pytest.mark.skipif(not kernels.available(), reason="splitinfer's kernels do not run on this CPU")


@pytest.mark.parametrize("kernel", ["native", "pytorch"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("cached", [0, 7, 600])
def test_exact_rows_attention_gives_each_row_the_bits_of_the_row_alone(cached, window, kernel, monkeypatch):
    """A tree row against the same query on a cache holding only its visible keys (a chain decoded one row
    at a time): the same bits; and the values of transformers' sdpa over the masked block."""
    if kernel == "pytorch":
        _pytorch_rows(monkeypatch)
    elif not kernels.available():
        pytest.skip("splitinfer's kernels do not run on this CPU")
    gen = torch.Generator().manual_seed(cached)
    parents = [-1, 0, 0, 1, 2, 2, 4, 0, 7, 3, 9, 9]
    rows, keys = len(parents), cached + len(parents)
    query = torch.randn(1, 6, rows, 16, generator=gen)
    key, value = (torch.randn(1, 2, keys, 16, generator=gen) for _ in range(2))
    mask = _tree_mask(parents, cached, window)
    native = kernel == "native"
    tree, _ = attention.exact_rows_sdpa(query, key, value, mask, 0.25, {}, native)
    for row in range(rows):
        seen = torch.nonzero(mask[0, 0, row] == 0)[:, 0]
        alone_mask = torch.zeros(1, 1, 1, len(seen))
        alone, _ = attention.exact_rows_sdpa(query[:, :, row : row + 1], key[:, :, seen].contiguous(),
                                             value[:, :, seen].contiguous(), alone_mask, 0.25, {}, native)
        assert torch.equal(tree[0, row], alone[0, 0]), row
    theirs, _ = sdpa_attention_forward(Attn(3), query, key, value, mask, scaling=0.25)
    torch.testing.assert_close(tree, theirs, rtol=1e-5, atol=1e-5)


def _gathering_exact_rows(query, key, value, mask, scaling):
    """The implementation exact_rows_sdpa had before it wrote scattered keys in place (the reference): each
    row's visible keys, a slice where they are one run, else gathered with index_select."""
    batch, heads, rows, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    out = query.new_empty((batch, rows, heads, dim))
    for b in range(batch):
        seen = (mask[b if mask.shape[0] > 1 else 0, 0, :, :keys] == 0).expand(rows, keys).numpy()
        for i in range(rows):
            index = np.flatnonzero(seen[i])
            run = slice(index[0], index[-1] + 1)
            if index[-1] - index[0] + 1 == len(index):
                k, v = key[b : b + 1, :, run], value[b : b + 1, :, run]
            else:
                k, v = (t[b : b + 1].index_select(2, torch.from_numpy(index)) for t in (key, value))
            q = query[b : b + 1, :, i].reshape(1, kv_heads, heads // kv_heads, dim)
            out[b, i] = F.scaled_dot_product_attention(q, k, v, scale=scaling).reshape(heads, dim)
    return out


def _random_block(gen, batch: int, cached: int, window: int | None, rows: int = 12):
    """query [B, 9, q, 16]; a cache-like buffer [B, 3, capacity, 16] and its key/value views [:K]; random
    trees (one per batch row) as a mask [B, 1, q, K]."""
    keys = cached + rows
    query = torch.randn(batch, 9, rows, 16, generator=gen)
    buffers = torch.randn(2, batch, 3, keys + 5, 16, generator=gen)
    parents = [[-1] + [int(torch.randint(-1 if i > 3 else 0, i, (), generator=gen)) for i in range(1, rows)]
               for _ in range(batch)]
    mask = torch.cat([_tree_mask(p, cached, window) for p in parents])
    return query, buffers, buffers[0, :, :, :keys], buffers[1, :, :, :keys], mask


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("cached", [0, 1, 37, 300])
def test_exact_rows_attention_has_the_bits_of_gathering_and_leaves_the_cache_as_it_was(cached, batch, window, monkeypatch):
    _pytorch_rows(monkeypatch)
    gen = torch.Generator().manual_seed(cached * 10 + batch)
    for _ in range(3):
        query, buffers, key, value, mask = _random_block(gen, batch, cached, window)
        before = buffers.clone()
        ours, _ = attention.exact_rows_sdpa(query, key, value, mask, 0.25, {}, True)
        assert torch.equal(buffers, before)  # every key and value back in place, also past the views' end
        assert torch.equal(ours, _gathering_exact_rows(query, key, value, mask, 0.25))


@pytest.mark.parametrize("mode", ["inference", "inference tensor outside it", "grad"])
def test_exact_rows_attention_writes_in_place_only_where_allowed(mode, monkeypatch):
    """A cache's buffers are inference tensors written under inference mode; outside it, or with autograd,
    the keys are copied first: the same bits either way, and the cache untouched."""
    _pytorch_rows(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    with torch.inference_mode(mode != "grad"):
        query, buffers, key, value, mask = _random_block(gen, 1, 37, None)
        reference = _gathering_exact_rows(query, key, value, mask, 0.25)
    before = buffers.clone()
    with torch.inference_mode(mode == "inference"):
        if mode == "grad":
            key.requires_grad_(), value.requires_grad_()
        ours, _ = attention.exact_rows_sdpa(query, key, value, mask, 0.25, {}, True)
    assert torch.equal(buffers, before) and torch.equal(ours, reference)


def test_exact_rows_attention_puts_the_cache_back_when_a_row_raises(monkeypatch):
    _pytorch_rows(monkeypatch)
    gen = torch.Generator().manual_seed(4)
    query, buffers, key, value, mask = _random_block(gen, 1, 37, None)
    before, calls, row = buffers.clone(), [], attention._row

    def failing(*args):
        calls.append(1)
        if len(calls) == 9:
            raise RuntimeError("row 9 fails")
        return row(*args)

    monkeypatch.setattr(attention, "_row", failing)
    with pytest.raises(RuntimeError, match="row 9 fails"):
        attention.exact_rows_sdpa(query, key, value, mask, 0.25, {}, True)
    assert torch.equal(buffers, before)


@needs_native
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("cached", [0, 1, 37, 300])
def test_native_rows_attention_is_sdpa_a_row_and_never_writes(cached, batch, window):
    """rows_attention.cpp against PyTorch's SDPA on each row's gathered keys: float32 rounding apart, the same
    values; the cache's buffers are only read."""
    gen = torch.Generator().manual_seed(cached * 10 + batch + 1)
    for _ in range(3):
        query, buffers, key, value, mask = _random_block(gen, batch, cached, window)
        before = buffers.clone()
        ours = attention.native_rows_sdpa(query, key, value, mask, 0.25)
        assert torch.equal(buffers, before)
        torch.testing.assert_close(ours, _gathering_exact_rows(query, key, value, mask, 0.25), rtol=1e-5, atol=1e-6)


@needs_native
@pytest.mark.parametrize("cached", [45, 130])
@pytest.mark.parametrize("dim, heads, kv_heads", [(64, 9, 3), (64, 10, 2), (128, 8, 2), (128, 6, 6), (80, 4, 2), (16, 9, 3)])
def test_native_rows_attention_gives_each_head_and_row_the_bits_it_has_alone(dim, heads, kv_heads, cached):
    """The kernel takes up to four 64-wide (two 128-wide) heads of a key/value head at once, and every row of a
    key/value head over each span of 64 keys in turn (130 cached: three spans, the last partial, rows of odd and
    even counts): each head's bits are those of a one-head call, and each row's those of the row alone (a tree's
    rows and their paths)."""
    gen = torch.Generator().manual_seed(dim + heads + cached)
    rows = 7
    query = torch.randn(heads, rows, dim, generator=gen)
    key, value = torch.randn(2, kv_heads, cached + rows, dim, generator=gen)
    seen = [list(range(cached)) + [cached + a for a in range(i + 1) if a % 2 == 0 or a == i] for i in range(rows)]
    index = torch.tensor([k for row in seen for k in row])
    offsets = torch.tensor([0] + list(np.cumsum([len(row) for row in seen])))
    block = torch.ops.splitinfer.rows_attention(query, key, value, index, offsets, 0.125)  # [q, H, d]
    group = heads // kv_heads
    for h in range(heads):
        g = h // group
        one = torch.ops.splitinfer.rows_attention(query[h : h + 1], key[g : g + 1], value[g : g + 1], index, offsets, 0.125)
        assert torch.equal(one[:, 0], block[:, h]), h
    for i in range(rows):
        alone = torch.ops.splitinfer.rows_attention(query[:, i : i + 1], key, value, torch.tensor(seen[i]),
                                                    torch.tensor([0, len(seen[i])]), 0.125)
        assert torch.equal(alone[0], block[i]), i
    reference = torch.stack([F.scaled_dot_product_attention(
        query[:, i : i + 1], key.repeat_interleave(group, 0)[:, seen[i]], value.repeat_interleave(group, 0)[:, seen[i]],
        scale=0.125)[:, 0] for i in range(rows)])
    torch.testing.assert_close(block, reference, rtol=1e-5, atol=1e-6)


@needs_native
def test_native_rows_attention_refuses_what_does_not_fit():
    key = torch.randn(3, 10, 16)
    with pytest.raises(RuntimeError, match="outside the 10 cached"):
        torch.ops.splitinfer.rows_attention(torch.randn(9, 1, 16), key, key, torch.tensor([3, 10]), torch.tensor([0, 2]), 0.25)
    with pytest.raises(RuntimeError, match="sees no keys"):
        torch.ops.splitinfer.rows_attention(torch.randn(9, 1, 16), key, key, torch.tensor([0]), torch.tensor([0, 0]), 0.25)
    with pytest.raises(RuntimeError, match="do not fit"):
        torch.ops.splitinfer.rows_attention(torch.randn(8, 1, 16), key, key, torch.tensor([0]), torch.tensor([0, 1]), 0.25)
