"""model/native_layer.py: an int4 or int8 decoder layer as one native call gives model/fastpath.py's bits, block by
block and in the cache, and leaves the layers it does not fit to transformers' forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitinfer.masks import chain_allowed, tree_allowed, tree_depths
from splitinfer import kernels
from splitinfer.model.formats import WeightFormats
from splitinfer.model.native_layer import NativeLayer
from splitinfer.model.prepare import prepare
from splitinfer.model.shards import load_cloud
from splitinfer.model.source import SourceModel
from tiny import tiny_model

needs_native = pytest.mark.skipif(not kernels.available(), reason="splitinfer's kernels do not run on this CPU")
PARENTS = [-1, 0, 0, 1, 2, 2, 4, 0]


def cloud_stack(tmp_path, family: str, weights: str):
    model = tiny_model(family)
    out = prepare(SourceModel(f"tiny-{family}", model.config, model, None), tmp_path / "shards", 2, 1, "float32",
                  weights=WeightFormats.parse(weights))
    return load_cloud(out / "cloud").stack


def run_blocks(stack, hidden: torch.Tensor, prefix: int):
    """A chain of `prefix` rows, committed, then a tree block: (the tree's output, the cache's keys/values)."""
    positions = torch.tensor([prefix + d for d in tree_depths(PARENTS)])
    cache = stack.new_cache()
    with torch.inference_mode():
        stack(hidden[:, :prefix], torch.arange(prefix), chain_allowed(prefix), cache)
        cache.commit_all()
        out = stack(hidden[:, prefix:], positions, np.asarray(tree_allowed(PARENTS)), cache)
    end = prefix + len(PARENTS)
    return out, [(k[:, :, :end].clone(), v[:, :, :end].clone()) for k, v in zip(cache._keys, cache._values)]


@needs_native
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("prefix", [1, 20])
@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_the_native_layer_gives_fastpaths_bits_and_cache(tmp_path, family, prefix, weights):
    """Qwen2 has q/k/v biases; Mistral's window (12) is shorter than the longer prefix."""
    stack = cloud_stack(tmp_path, family, weights)
    assert all(isinstance(layer, NativeLayer) for layer in stack.layers)
    torch.manual_seed(3)
    hidden = torch.randn(1, prefix + len(PARENTS), stack.config.hidden_size)
    assert stack._stack_call is not None  # a lone block: every layer in one call (native_layer.StackCall)
    runs = [run_blocks(stack, hidden, prefix)]
    stack._stack_call = None  # the stack's pass calls the kernel a layer (native_layer.run)
    runs.append(run_blocks(stack, hidden, prefix))
    stack._native = False  # each layer's forward calls it
    runs.append(run_blocks(stack, hidden, prefix))
    for i, layer in enumerate(stack.layers):  # the modules it was built from (model/fastpath.py's forwards)
        stack.layers[i] = layer.transformers
    composed_out, composed_cache = run_blocks(stack, hidden, prefix)
    for out, cache in runs:
        assert torch.equal(out, composed_out)
        for (k, v), (k2, v2) in zip(cache, composed_cache):
            assert torch.equal(k, k2) and torch.equal(v, v2)


@needs_native
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_stacks_rotary_table_gives_the_rotary_modules_bits(tmp_path, family):
    """A table row for each position, grown in slices, against the module called on the block's positions."""
    stack = cloud_stack(tmp_path, family, "int8")
    call = stack._stack_call
    with torch.inference_mode():
        call._cover(700)
        for positions in ([0], [5, 6, 7], list(range(250, 262)), [699, 3, 512], list(range(64))):
            ids = torch.tensor([positions])
            cos, sin = stack.rotary(torch.empty(0), ids)
            assert torch.equal(call.cos[ids[0]], cos[0]) and torch.equal(call.sin[ids[0]], sin[0])


@needs_native
def test_the_stack_call_refuses_a_position_past_its_table_or_a_short_cache_and_a_held_block_takes_the_masks(tmp_path):
    """Every operand is checked before the first layer writes its cache."""
    stack = cloud_stack(tmp_path, "llama", "int8")
    call, d = stack._stack_call, stack.config.hidden_size
    cache = stack.new_cache()
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="position 900 is past the rotary table"):
            call.kernel.run(torch.zeros(1, d), call.cos, call.sin, torch.tensor([900]), torch.ones(1, 1, dtype=torch.bool),
                            0, *cache.block_buffers(len(stack.layers), 1, call.like)[:2])
        keys, values, _ = cache.block_buffers(len(stack.layers), 1, call.like)
        first = keys[0].zero_().clone()  # (new buffers hold whatever memory held: NaN is not equal to itself)
        short = [k[:, :, :0] for k in keys[-1:]]  # the last layer's cache holds no slot: nothing may be written
        with pytest.raises(RuntimeError, match="do not fit a cache of 0 slots"):
            call.kernel.run(torch.randn(1, d), call.cos, call.sin, torch.tensor([0]), torch.ones(1, 1, dtype=torch.bool),
                            0, keys[:-1] + short, values[:-1] + short)
        assert torch.equal(keys[0], first)
        cache.truncate(0)
        stack(torch.randn(1, 2, d), torch.arange(2), chain_allowed(2), cache)
        cache.hold()
        calls = []
        stack._stack_call = lambda *args: calls.append(args)
        out = stack(torch.randn(1, 1, d), torch.tensor([2]), chain_allowed(1), cache)
    assert out.shape == (1, 1, d) and not calls  # a block behind a held one: its mask sees the held rows


@needs_native
@pytest.mark.parametrize("weights", ["float32", "bfloat16"])
def test_layers_without_four_integer_products_keep_the_python_forward(tmp_path, weights):
    stack = cloud_stack(tmp_path, "llama", weights)
    assert not any(isinstance(layer, NativeLayer) for layer in stack.layers)


@needs_native
def test_a_batch_of_sessions_or_another_cache_takes_transformers_forward(tmp_path):
    """The same layer objects serve `run_layers` on a batch ([B, q, d]); the native call takes one session."""
    stack = cloud_stack(tmp_path, "llama", "int4")
    layer = stack.layers[0]
    hidden = torch.randn(2, 3, stack.config.hidden_size)
    assert not layer.runs_native(hidden, stack.new_cache())
    assert not layer.runs_native(hidden[:1], object())
    assert layer.runs_native(hidden[:1], stack.new_cache())


@needs_native
def test_the_kernel_refuses_slots_outside_the_written_block(tmp_path):
    """A visible key past the rows written so far would read another block's (or no one's) keys."""
    stack = cloud_stack(tmp_path, "llama", "int4")
    layer, config = stack.layers[0], stack.config
    dim = config.hidden_size // config.num_attention_heads
    cache = torch.zeros(config.num_key_value_heads, 8, dim)
    hidden, cos, sin = torch.randn(2, config.hidden_size), torch.ones(2, dim), torch.zeros(2, dim)
    args = (hidden, cos, sin, cache, cache.clone(), 0)
    tail = (layer._weights, config.num_attention_heads, config.num_key_value_heads, 1e-5, 0.25)
    ok = torch.ops.splitinfer.decoder_layer(*args, torch.tensor([0, 0, 1]), torch.tensor([0, 1, 3]), *tail)
    assert ok.shape == hidden.shape
    with pytest.raises(RuntimeError, match="key slot 2 outside the 2 cached"):
        torch.ops.splitinfer.decoder_layer(*args, torch.tensor([0, 0, 2]), torch.tensor([0, 1, 3]), *tail)
    with pytest.raises(RuntimeError, match="do not fit a cache of 8 slots"):
        torch.ops.splitinfer.decoder_layer(*args[:5], 7, torch.tensor([7, 7, 8]), torch.tensor([0, 1, 3]), *tail)
