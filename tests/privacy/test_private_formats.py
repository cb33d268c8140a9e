"""Private weights keep the shard's weight formats: `privacy privatize` quantizes its new int8/int4 local layers
again from the private float weights (int8 calibrated on them), and `privatize --basis` writes both keyed shards
in the formats the prepared shards had (model/prepare.py `restored_layers`, privacy/basis.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tiny import tiny_model

from splitinfer.clients import open_client
from splitinfer.model.formats import WeightFormats, dequantize
from splitinfer.model.manifest import WEIGHTS, local_weights_are_public, read_manifest
from splitinfer.model.prepare import prepare
from splitinfer.model.shards import load_whole_hf
from splitinfer.model.source import SourceModel
from splitinfer.privacy.basis import BasisConfig, apply_basis, write_basis_shards
from splitinfer.privacy.privatize import PrivatizeConfig, privatize_model, write_private_shard

# int8 per output row with SmoothQuant, int4 in groups of 32: a weight's relative error once stored
TOLERANCE = {"int8": 0.03, "int4": 0.2}


def _shards(tmp_path, fmt: str):
    model = tiny_model("llama", 0)
    out = prepare(SourceModel("tiny-llama", model.config, model, None), tmp_path / fmt, 2, 2, "float32",
                  weights=WeightFormats.parse(fmt))
    return model, out


def _linear(state: dict, prefix: str) -> torch.Tensor:
    return dequantize({name: state[prefix + name] for name in ("qweight", "scale", "min", "smooth") if prefix + name in state})


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_privatize_quantizes_the_private_local_layers_again(tmp_path, fmt):
    _, shards = _shards(tmp_path, fmt)
    public = load_whole_hf(shards)
    rng = np.random.default_rng(0)
    text = [rng.integers(0, 96, size=32).tolist() for _ in range(6)]
    private, record = privatize_model(public, text, PrivatizeConfig(steps=2, batch_chunks=2, seq_len=32, seed=7))
    out = write_private_shard(private, shards, tmp_path / "private", record)

    before, after = load_file(str(shards / "local" / WEIGHTS)), load_file(str(out / "local" / WEIGHTS))
    assert {k: v.dtype for k, v in after.items()} == {k: v.dtype for k, v in before.items()}  # same keys, same formats
    weights = private.state_dict()
    prefixes = sorted(k[: -len("qweight")] for k in after if k.startswith("model.layers.") and k.endswith("qweight"))
    assert prefixes, "the local layers are stored quantized"
    changed = 0
    for prefix in prefixes:
        want = weights[prefix + "weight"].float()
        got = _linear(after, prefix)
        assert (got - want).norm() / want.norm() < TOLERANCE[fmt], prefix  # the private weight, quantized
        changed += not torch.equal(after[prefix + "qweight"], before[prefix + "qweight"])
    assert changed, "the private weights replaced the public ones"
    assert not local_weights_are_public(read_manifest(out / "local", "local"))
    tokens = open_client(local_only=True, shards=out).generate([3, 5, 7], max_new_tokens=4, stop_ids=set())
    assert len(tokens.token_ids) == 4


def test_basis_shards_keep_the_prepared_formats(tmp_path):
    _, shards = _shards(tmp_path, "int8,cloud=int4")
    keyed, secret, record = apply_basis(load_whole_hf(shards), BasisConfig(seed=3, key="orthogonal"))
    out, _ = write_basis_shards(keyed, secret, shards, tmp_path / "keyed", record)
    for role in ("local", "cloud"):
        assert read_manifest(out / role, role)["weights"] == read_manifest(shards / role, role)["weights"]
        before, after = load_file(str(shards / role / WEIGHTS)), load_file(str(out / role / WEIGHTS))
        assert sorted(after) == sorted(before)
    tokens = open_client(local_only=True, shards=out).generate([3, 5, 7], max_new_tokens=4, stop_ids=set())
    assert len(tokens.token_ids) == 4
