"""Multi-device placement of the middle layers, checked on CPU with fake device names and memories."""

from __future__ import annotations

import pytest
import torch

from splitinfer.cloud.sessions import SessionConfig, SessionTable
from splitinfer.errors import ConfigError
from splitinfer.masks import BlockStructure
from splitinfer.model.placement import parse_devices, place_layers, plan_device_map
from splitinfer.model.shards import load_cloud
from splitinfer.model.stack import LayerStack, skeleton
from splitinfer.wire.messages import Hello, Step

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


def test_placed_stack_runs_the_same(tmp_path):
    """A stack placed layer by layer computes what the unplaced one does. CPU is one device to torch
    ('cpu' and 'cpu:0' are the same), so this checks the placement plumbing, not a real device crossing."""
    _, shards = prepare_tiny(tmp_path, "qwen2", 1, 1)
    plain, placed = load_cloud(shards / "cloud"), load_cloud(shards / "cloud")
    place_layers(placed.stack, {0: "cpu", 1: "cpu", 2: "cpu:0", 3: "cpu:0"})
    assert len(placed.stack.devices) == 4
    outs = []
    for half in (plain, placed):
        table = SessionTable(half, SessionConfig())
        session, _ = table.open(Hello(half.fingerprint, (half.stack.start, half.stack.end), "float32"))
        hidden = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
        first = table.run_step(session, Step(0, (), tuple(range(6)), BlockStructure.chain(), hidden, "float32"), 0.0)
        step = Step(1, tuple(range(6)), (6,), BlockStructure.chain(), hidden[:1], "float32")
        second = table.run_step(session, step, 0.0)
        outs.append((first.hidden, second.hidden))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
