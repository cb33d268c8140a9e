"""model/fused.py: sibling products fused into one give each sibling the bits it had on its own, and only
siblings that can share a quantized input fuse."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from splitinfer.model import formats, linears
from splitinfer import kernels
from splitinfer.model.fused import Slice, fuse_layer, group_column_maxima

SIZES = {"q_proj": 64, "k_proj": 32, "v_proj": 32}


def _layer(fmt: str, shared_smoothing: bool) -> tuple[nn.Module, dict[str, nn.Module]]:
    """A stand-in decoder layer: self_attn with q/k/v of 96 inputs in `fmt`."""
    torch.manual_seed(0)
    weights = {f"model.layers.0.self_attn.{name}.weight": torch.randn(n, 96) for name, n in SIZES.items()}
    columns = group_column_maxima(weights) if shared_smoothing else {}
    act_max = torch.rand(96) * 10
    layer, attn, alone = nn.Module(), nn.Module(), {}
    layer.self_attn = attn
    for key, weight in weights.items():
        name = key.split(".")[-2]
        state = formats.quantize(weight, fmt, act_max if fmt == "int8" else None, columns.get(key))
        module = linears.quant_module(fmt, 96, SIZES[name], bias=False, smooth="smooth" in state)
        module.load_state_dict(state)
        module.finish()
        setattr(attn, name, module)
        alone[name] = module
    return layer, alone


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_each_fused_sibling_has_the_bits_it_had_alone_in_any_call_order(fmt):
    layer, alone = _layer(fmt, shared_smoothing=True)
    assert fuse_layer(layer) == 1
    attn = layer.self_attn
    assert all(isinstance(getattr(attn, name), Slice) for name in SIZES)
    x = torch.randn(5, 96) * 3
    with torch.inference_mode():
        for order in (("q_proj", "k_proj", "v_proj"), ("v_proj", "q_proj", "k_proj"), ("k_proj",)):
            for name in order:
                assert torch.equal(getattr(attn, name)(x), alone[name](x)), (order, name)
            other = x + 1  # a new input is never answered from the last one's product
            assert torch.equal(attn.k_proj(other), alone["k_proj"](other))
    torch.testing.assert_close(attn.k_proj.weight, alone["k_proj"].weight)


def test_int8_siblings_smoothed_one_by_one_stay_unfused():
    layer, alone = _layer("int8", shared_smoothing=False)
    assert fuse_layer(layer) == 0
    assert layer.self_attn.q_proj is alone["q_proj"]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_fused_layers_take_the_direct_forwards_with_transformers_bits(tmp_path, family, fmt):
    """model/fastpath.py: a tree block on a cache through the direct attention and MLP forwards, and through
    transformers' own forwards (over the same fused products): the same bits."""
    import numpy as np

    from splitinfer.masks import chain_allowed, tree_allowed, tree_depths
    from splitinfer.model.fastpath import FusedAttention, FusedMLP
    from splitinfer.model.formats import WeightFormats
    from splitinfer.model.prepare import prepare
    from splitinfer.model.shards import load_cloud
    from splitinfer.model.source import SourceModel
    from tiny import tiny_model

    model = tiny_model(family)
    out = prepare(SourceModel(f"tiny-{family}", model.config, model, None), tmp_path / "shards", 2, 1, "float32",
                  weights=WeightFormats.parse(fmt))
    with kernels.choosing(kernels.KernelSet(decoder_layer=False)):  # the layers' modules, not one native call
        stack = load_cloud(out / "cloud").stack
    assert all(isinstance(layer.self_attn, FusedAttention) and isinstance(layer.mlp, FusedMLP) for layer in stack.layers)
    parents = [-1, 0, 0, 1, 2, 2, 4, 0]
    torch.manual_seed(3)
    hidden = torch.randn(1, 20 + len(parents), stack.config.hidden_size)
    positions = torch.tensor([20 + d for d in tree_depths(parents)])

    def block():
        cache = stack.new_cache()
        stack(hidden[:, :20], torch.arange(20), chain_allowed(20), cache)
        cache.commit_all()
        return stack(hidden[:, 20:], positions, np.asarray(tree_allowed(parents)), cache)

    with torch.inference_mode():
        direct = block()
        for layer in stack.layers:  # transformers' forwards over the same products
            layer.self_attn, layer.mlp = layer.self_attn.transformers, layer.mlp.transformers
        assert torch.equal(block(), direct)
