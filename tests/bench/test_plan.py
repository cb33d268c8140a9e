"""`splitinfer plan`: parameter counts against real (tiny) HF models, wire sizes against the real codec,
and the paper's figures for Mistral 7B and NeMo 12B."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from splitinfer.bench.commands import register
from splitinfer.bench.plan import PACKAGED_CONFIGS, load_config, max_rows_in_message, message_bytes, paper_check, plan
from splitinfer.errors import ConfigError
from splitinfer.masks import BlockStructure
from splitinfer.wire.messages import Result, Step

from tiny import tiny_model


def _count(module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_parameter_counts_match_a_real_model(family):
    model = tiny_model(family)
    cfg = model.config.to_dict()
    r = plan(cfg, head=2, tail=1, dtype="float32")
    layers = model.model.layers
    cloud = sum(_count(layer) for layer in layers[2 : len(layers) - 1])
    assert r["cloud_params"] == cloud
    # tied models count the shared matrix once, like parameters() does
    assert r["total_params"] == _count(model)
    assert r["local_params"] == _count(model) - cloud
    assert r["local_weight_bytes"] == 4 * r["local_params"]


def test_kv_bytes_per_token():
    cfg = tiny_model("llama").config.to_dict()  # 6 layers, 2 KV heads of 16
    r = plan(cfg, head=2, tail=2, dtype="float16")
    assert r["local_kv_bytes_per_token"] == 4 * 2 * 2 * 16 * 2
    assert r["cloud_kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2


def test_wire_sizes_are_the_codec_s():
    cfg = tiny_model("llama").config.to_dict()
    r = plan(cfg, dtype="float16")
    step = Step(7, (0,), (1000,), BlockStructure.chain(), torch.zeros(1, 64), "float16").encode()
    result = Result(7, torch.zeros(1, 64), 12.3456, 12.3456, 1000, "float16").encode()
    assert r["wire_bytes_per_decode_token_up_down"] == [len(step), len(result)]
    assert r["wire_bytes_per_decode_token"] == len(step) + len(result)
    big = Step(7, (), tuple(range(300)), BlockStructure.chain(), torch.zeros(300, 64), "bfloat16").encode()
    assert message_bytes(300, 64, "bfloat16", 0, "step") == len(big)


def test_longest_unchunked_message_is_exact():
    limit = 50_000
    rows = max_rows_in_message(64, "float16", limit)
    fits = Step(0, (), tuple(range(rows)), BlockStructure.chain(), torch.zeros(rows, 64), "float16").encode()
    over = Step(0, (), tuple(range(rows + 1)), BlockStructure.chain(), torch.zeros(rows + 1, 64), "float16").encode()
    assert len(fits) <= limit < len(over)


def test_paper_figures():
    _, mistral = load_config("mistral-7b-v0.1")
    r = plan(mistral, 2, 2, "float16")
    assert r["hidden_state_bytes"] == 8192  # "8 KB per float16 hidden state at 4096"
    assert r["total_params"] == pytest.approx(7.24e9, rel=0.005)
    # the paper's 2.0 GB is 4 layers + one 32000 x 4096 matrix; the untied LM head adds another
    vocab_matrix = 32000 * 4096 * 2
    assert r["local_weight_bytes"] - vocab_matrix == pytest.approx(2.0e9, rel=0.01)
    assert "+13%" in paper_check("mistral-7b-v0.1", r)
    _, nemo = load_config("mistral-nemo-12b")
    r = plan(nemo, 2, 2, "float16")
    assert r["local_weight_bytes"] == pytest.approx(4.9e9, rel=0.01)
    assert r["total_params"] == pytest.approx(12.25e9, rel=0.005)


@pytest.mark.parametrize("name, billions", [("llama-3.1-8b", 8.03), ("llama-3.1-70b", 70.55), ("llama-3.1-405b", 405.85)])
def test_llama_configs(name, billions):
    _, cfg = load_config(name)
    assert plan(cfg)["total_params"] / 1e9 == pytest.approx(billions, abs=0.01)


def test_cli_json(capsys):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["plan", "--config", "llama-3.1-70b", "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("local_weight_bytes", "cloud_weight_bytes", "local_kv_bytes_per_token", "cloud_kv_bytes_per_token",
                "wire_bytes_per_decode_token", "max_unchunked_prompt_tokens"):
        assert isinstance(out[key], int) and out[key] > 0
    assert set(PACKAGED_CONFIGS) >= {"mistral-7b-v0.1", "mistral-nemo-12b", "llama-3.1-70b", "llama-3.1-405b"}


@pytest.mark.parametrize(
    "cfg, kwargs, match",
    [
        ({"model_type": "gpt2"}, {}, "model_type is 'gpt2'"),
        ({"model_type": "llama", "hidden_size": 8}, {}, "lacks or mangles"),
        ({**tiny_model("llama").config.to_dict()}, {"head": 3, "tail": 3}, "head \\+ tail < 6"),
        ({**tiny_model("llama").config.to_dict()}, {"dtype": "int8"}, "--dtype"),
    ],
)
def test_bad_input_is_explained(cfg, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        plan(cfg, **kwargs)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(str(tmp_path / "nope.json"))
