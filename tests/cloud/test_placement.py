"""Multi-device placement of the middle layers, checked on CPU with fake device names and memories."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitinfer.errors import ConfigError
from splitinfer.model.placement import parse_devices, place_layers, plan_device_map
from splitinfer.model.shards import load_cloud
from splitinfer.model.stack import LayerStack, skeleton

from tiny import TINY_CONFIGS, prepare_tiny


def meta_stack(family: str = "llama", start: int = 1, end: int = 5) -> LayerStack:
    config = TINY_CONFIGS[family]()
    model = skeleton(config)
    return LayerStack(config, list(model.model.layers)[start:end], start, model.model.rotary_emb)


def layer_bytes(stack: LayerStack, dtype=torch.float32) -> int:
    return sum(p.numel() for p in stack.layers[0].parameters()) * torch.finfo(dtype).bits // 8


def test_layers_are_spread_in_order_within_each_devices_memory():
    stack = meta_stack()
    size = layer_bytes(stack)
    memory = {"cuda:0": 10 * size, "cuda:1": 10 * size}
    device_map = plan_device_map(stack, memory, torch.float32)
    assert sorted(device_map) == [0, 1, 2, 3]
    order = [device_map[i] for i in range(4)]
    assert order == sorted(order)  # contiguous runs: activations cross each device boundary once
    assert set(order) == {"cuda:0", "cuda:1"}  # balanced, not everything on the first device


def test_half_precision_needs_half_the_memory():
    stack = meta_stack()
    size = layer_bytes(stack)  # float32 bytes of one layer
    memory = {"cuda:0": int(3.5 * size)}  # 70% usable = 2.45 float32 layers: four fit in float16 only
    with pytest.raises(ConfigError, match="do not fit"):
        plan_device_map(stack, memory, torch.float32)
    assert set(plan_device_map(stack, memory, torch.float16).values()) == {"cuda:0"}


def test_bad_device_lists_are_refused():
    with pytest.raises(ConfigError):
        plan_device_map(meta_stack(), {}, torch.float32)
    with pytest.raises(ConfigError, match="not a device"):
        parse_devices("gpu0")
    assert parse_devices("cuda:0, cuda:1") == ["cuda:0", "cuda:1"]
    with pytest.raises(ConfigError, match="every layer"):
        place_layers(meta_stack(), {0: "cpu"})


def _run_two_blocks(stack: LayerStack, record_layer: int) -> list[torch.Tensor]:
    """A 6-row prompt block, all of it kept, then a 1-row block; the output of layer `record_layer` of each."""
    seen = []

    def record(_module, _inputs, out):
        seen.append(out[0] if isinstance(out, tuple) else out)

    handle = stack.layers[record_layer].register_forward_hook(record)
    hidden = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(0))
    cache = stack.new_cache()
    try:
        stack(hidden, torch.arange(6), np.tril(np.ones((6, 6), bool)), cache)
        cache.keep(range(6))
        stack(hidden[:, :1], torch.tensor([6]), np.ones((1, 1), bool), cache)
    finally:
        handle.remove()
    return seen


def test_planned_placement_runs_each_layer_on_its_own_device(tmp_path):
    """The planner's map over two distinct devices is where the layers live and where their inputs arrive.

    CPU is one device to torch, so the second device is `meta` (shapes without values): a layer left on
    the wrong device, or an activation not moved across the boundary, fails on the device check or in the
    layer itself; the layers before the boundary must compute exactly what the unplaced stack does.
    """
    _, shards = prepare_tiny(tmp_path, "qwen2", 1, 1)
    plain, placed = load_cloud(shards / "cloud").stack, load_cloud(shards / "cloud").stack
    size = layer_bytes(placed)
    device_map = plan_device_map(placed, {"cpu": 10 * size, "meta": 10 * size}, torch.float32)
    assert device_map == {0: "cpu", 1: "cpu", 2: "meta", 3: "meta"}  # balanced, contiguous, in the given order
    place_layers(placed, device_map)
    for index, layer in enumerate(placed.layers):
        assert {p.device.type for p in layer.parameters()} == {device_map[index]}, index
    assert [d.type for d in placed.devices] == ["cpu", "cpu", "meta", "meta"]
    inputs = []
    hooks = [layer.register_forward_pre_hook(lambda _m, args, kwargs: inputs.append(
        (args[0] if args else kwargs["hidden_states"]).device.type), with_kwargs=True) for layer in placed.layers]
    boundary = _run_two_blocks(placed, 1)
    for hook in hooks:
        hook.remove()
    assert inputs == ["cpu", "cpu", "meta", "meta"] * 2  # each block enters every layer on that layer's device
    for got, want in zip(boundary, _run_two_blocks(plain, 1)):
        assert got.device.type == "cpu" and torch.equal(got, want)
    last = _run_two_blocks(placed, 3)
    assert [(t.device.type, tuple(t.shape)) for t in last] == [("meta", (1, 6, 64)), ("meta", (1, 1, 64))]
