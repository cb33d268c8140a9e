"""model/attention.py: grouped queries stacked as rows compute transformers' sdpa result, and loaded shards use it."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

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


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("cached", [0, 7, 600])
def test_exact_rows_attention_gives_each_row_the_bits_of_the_row_alone(cached, window):
    """A tree row against the same query on a cache holding only its visible keys (a chain decoded one row
    at a time): the same bits; and the values of transformers' sdpa over the masked block."""
    gen = torch.Generator().manual_seed(cached)
    parents = [-1, 0, 0, 1, 2, 2, 4, 0, 7, 3, 9, 9]
    rows, keys = len(parents), cached + len(parents)
    query = torch.randn(1, 6, rows, 16, generator=gen)
    key, value = (torch.randn(1, 2, keys, 16, generator=gen) for _ in range(2))
    mask = _tree_mask(parents, cached, window)
    tree, _ = attention.exact_rows_sdpa(query, key, value, mask, 0.25, {})
    for row in range(rows):
        seen = torch.nonzero(mask[0, 0, row] == 0)[:, 0]
        alone_mask = torch.zeros(1, 1, 1, len(seen))
        alone, _ = attention.exact_rows_sdpa(query[:, :, row : row + 1], key[:, :, seen].contiguous(),
                                             value[:, :, seen].contiguous(), alone_mask, 0.25, {})
        assert torch.equal(tree[0, row], alone[0, 0]), row
    theirs, _ = sdpa_attention_forward(Attn(3), query, key, value, mask, scaling=0.25)
    torch.testing.assert_close(tree, theirs, rtol=1e-5, atol=1e-5)
