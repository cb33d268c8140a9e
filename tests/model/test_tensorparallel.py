"""Tensor-parallel slicing of the middle layers (model/tensorparallel.py) and what `serve --tp` checks before it
starts any process. The multi-process runs are in tests/cloud/test_tensorparallel.py (`make test-tp`)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from splitinfer.cloud.tensorparallel import check_launch
from splitinfer.errors import ConfigError, ModelError
from splitinfer.model.tensorparallel import check_divisible, shard_linear, tp_plan

from tiny import TINY_CONFIGS, prepare_tiny


@pytest.mark.parametrize("bias", [False, True])
def test_colwise_slices_concatenate_and_rowwise_slices_sum_to_the_whole_product(bias):
    torch.manual_seed(0)
    whole = nn.Linear(8, 12, bias=bias)
    x = torch.randn(3, 8)
    expected = whole(x)
    cols = [copy.deepcopy(whole) for _ in range(2)]
    for rank, part in enumerate(cols):
        shard_linear(part, "colwise", rank, 2)
        assert part.weight.shape == (6, 8) and part.out_features == 6
    assert torch.allclose(torch.cat([part(x) for part in cols], dim=-1), expected)
    rows = [copy.deepcopy(whole) for _ in range(2)]
    for rank, part in enumerate(rows):
        shard_linear(part, "rowwise", rank, 2)
        assert part.weight.shape == (12, 4) and part.in_features == 4
    # What the all-reduce after a rowwise projection adds up: each rank's input slice through its columns.
    total = rows[0](x[:, :4]) + rows[1](x[:, 4:])
    assert torch.allclose(total, expected, atol=1e-6)


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_every_supported_family_has_a_plan_splitinfer_applies(family):
    plan = tp_plan(TINY_CONFIGS[family]())
    assert plan["self_attn.q_proj"] == "colwise" and plan["mlp.down_proj"] == "rowwise"


def test_a_plan_style_splitinfer_does_not_apply_is_refused():
    config = TINY_CONFIGS["llama"]()
    config.base_model_tp_plan = {**config.base_model_tp_plan, "layers.*.mlp.down_proj": "rowwise_split_input"}
    with pytest.raises(ModelError, match="without --tp"):
        tp_plan(config)


def test_ranks_that_do_not_divide_the_heads_are_refused_with_the_choices():
    config = TINY_CONFIGS["llama"]()  # 4 heads, 2 KV heads, 128 MLP neurons
    check_divisible(config, 2)
    with pytest.raises(ConfigError, match=r"--tp 4 does not divide .*2 KV heads.*choose --tp among 1, 2\."):
        check_divisible(config, 4)
    with pytest.raises(ConfigError, match="4 attention heads"):
        check_divisible(config, 3)


def test_serve_tp_checks_the_shard_and_torch_distributed_before_starting(tmp_path, monkeypatch):
    _, shards = prepare_tiny(tmp_path, "llama", 2, 2)
    cloud = str(shards / "cloud")
    check_launch(cloud, 2, "cpu")
    with pytest.raises(ConfigError, match="choose --tp among 1, 2"):
        check_launch(cloud, 3, "cpu")
    with pytest.raises(ConfigError, match="--device cuda, not a GPU index"):
        check_launch(cloud, 2, "cuda:1")
    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no torch.distributed"):
        check_launch(cloud, 2, "cpu")
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_gloo_available", lambda: False)
    with pytest.raises(ConfigError, match="gloo"):
        check_launch(cloud, 2, "cpu")
