"""A quantized shard off the CPU: the int8/int4 products are CPU kernels, so another device (a GPU cloud) loads
the float weights the shard stands for (formats.for_device). Checked on the CPU with the kernels declared absent:
no integer module is built, and split greedy decoding equals transformers on the dequantized model.
(`prepare --weights auto`'s choice, a GPU cloud's included: tests/model/test_autoformat.py.)"""

from __future__ import annotations

import pytest
from tiny import assert_local_only_matches_hf, tiny_model

from splitinfer.model import formats
from splitinfer.model.formats import WeightFormats
from splitinfer.model.linears import QuantLinear
from splitinfer.model.prepare import prepare
from splitinfer.model.shards import load_cloud, load_local, load_whole_hf
from splitinfer.model.source import SourceModel


@pytest.mark.parametrize("spec", ["int8", "int4,lm_head=int8"])
def test_a_device_without_integer_kernels_computes_with_the_weights_they_stand_for(tmp_path, monkeypatch, spec):
    model = tiny_model("llama", 0)
    shards = prepare(SourceModel("tiny-llama", model.config, model, None), tmp_path / "s", 2, 2, "float32",
                     weights=WeightFormats.parse(spec))
    assert any(isinstance(m, QuantLinear) for m in load_cloud(shards / "cloud").stack.modules())  # on the CPU
    monkeypatch.setattr(formats, "has_integer_kernels", lambda device: False)
    local, cloud = load_local(shards / "local"), load_cloud(shards / "cloud")
    for module in (local.head, local.tail, local.lm_head, cloud.stack):
        assert not any(isinstance(m, QuantLinear) for m in module.modules())
    assert_local_only_matches_hf(load_whole_hf(shards), shards, [3, 5, 7, 11], 8)

