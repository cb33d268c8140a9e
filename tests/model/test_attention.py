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
