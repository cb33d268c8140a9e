"""`prepare --weights auto` (model/autoformat.py): the choice for each kind of source and machine, and what the
command makes of the files users download: a GGUF of Q8_0/Q4_K blocks and a bfloat16 safetensors checkpoint
prepare into int8 on a CPU with an int8 product, speculation stays token-identical to sequential decoding in
that format, and `--weights float32` still gives float32."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from splitinfer.cli import main
from splitinfer.clients import open_client
from splitinfer.model.autoformat import MEASURED_INT8, RECOMMENDED, auto_formats, choose, int8_product_here
from splitinfer.model.formats import WeightFormats
from splitinfer.model.source import SourceModel, load_source

from tiny import tiny_model

PROMPT = [3, 17, 42, 5, 88, 21, 9, 60, 33, 7, 14, 2, 71]
Q4_K_M = {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}  # the block types of the Gemma 3 270M Q4_K_M file's layers


@pytest.mark.parametrize("kind, types", [("gguf", Q4_K_M), ("gguf", {"Q8_0"}), ("gguf", {"Q5_K", "Q6_K"}),
                                         ("gguf", {"Q4_1"}), ("gguf", {"F16"}), ("safetensors", {"BF16"}),
                                         ("safetensors", {"F16"}), ("safetensors", {"F32"}), ("memory", {"float32"})])
@pytest.mark.parametrize("product", MEASURED_INT8)
def test_a_cpu_with_an_int8_product_gets_int8_from_every_float_or_gguf_source(kind, types, product):
    choice = choose(kind, types, product)
    assert choice.weights == RECOMMENDED == WeightFormats.parse("int8")
    assert ("dequantized and quantized again" in choice.reason) is (kind == "gguf" and types != {"F16"})
    assert ("--weights int4` keeps them" in choice.reason) is (types == {"Q4_1"})


def test_without_a_measured_int8_product_every_weight_stays_in_dtype():
    for product in ("int_mm", None):
        choice = choose("gguf", Q4_K_M, product, dtype="float32")
        assert choice.weights is None and "not measured faster" in choice.reason
    unknown = choose("safetensors", {"I32", "F16"}, "splitinfer", dtype="bfloat16")  # an integer-packed checkpoint
    assert unknown.weights is None and "every weight in bfloat16" in unknown.reason


def test_a_gpu_cloud_gets_bfloat16_layers_and_the_local_side_keeps_int8():
    assert choose("safetensors", {"BF16"}, "fbgemm", "cuda").weights == WeightFormats("int8", "bfloat16", "int8")
    assert choose("safetensors", {"BF16"}, "int_mm", "cuda").weights == WeightFormats("float32", "bfloat16", "float32")


def test_a_model_in_memory_is_chosen_by_its_own_dtypes():
    model = tiny_model("llama", 0)
    choice = auto_formats(SourceModel("m", model.config, model, None))
    expected = RECOMMENDED if int8_product_here() in MEASURED_INT8 else None
    assert "float32" in choice.reason and choice.weights == expected


# -- the command on files ---------------------------------------------------------------------------------------


@pytest.fixture
def tiny_gguf(tmp_path):
    pytest.importorskip("gguf", reason="reading GGUF files needs the [gguf] extra: pip install 'splitinfer[gguf]'")
    from tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(tmp_path / "tiny-q4_k_m.gguf", ("Q8_0", "Q4_K", "Q6_K"))


@pytest.fixture
def tiny_safetensors(tmp_path):
    model = tiny_model("llama", 0).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "tiny-bf16")  # safetensors, bfloat16: a checkpoint as users download one
    return tmp_path / "tiny-bf16"


def _prepare(source, out, *options) -> dict:
    assert main(["prepare", "--model", str(source), "--out", str(out), "--head-layers", "1", "--tail-layers", "1",
                 *options]) == 0
    return json.loads((out / "local" / "manifest.json").read_text())


def _expected() -> dict:
    if int8_product_here() not in MEASURED_INT8:
        pytest.skip("this CPU runs neither splitinfer's nor FBGEMM's int8 product: auto keeps --dtype here")
    return RECOMMENDED.as_dict()


def test_the_gguf_reader_names_each_layer_weights_block_type(tiny_gguf):
    source = load_source(tiny_gguf)
    assert source.kind == "gguf" and set(source.stored_types.values()) == {"Q8_0", "Q4_K", "Q6_K"}
    assert all(k.startswith("model.layers.") for k in source.stored_types)


@pytest.mark.parametrize("which", ["gguf", "safetensors"])
def test_auto_prepares_a_downloaded_file_in_int8_and_speculation_equals_sequential(which, tiny_gguf, tiny_safetensors,
                                                                                   tmp_path, capsys):
    expected = _expected()
    manifest = _prepare(tiny_gguf if which == "gguf" else tiny_safetensors, tmp_path / "auto")
    assert manifest["weights"] == expected
    assert manifest["weights_reason"] in capsys.readouterr().out
    assert ("Q4_K, Q6_K, Q8_0 blocks dequantized" in manifest["weights_reason"]) is (which == "gguf")
    cloud = load_file(str(tmp_path / "auto" / "cloud" / "weights.safetensors"))
    assert cloud["model.layers.1.mlp.down_proj.qweight"].dtype == torch.int8
    client = open_client(local_only=True, shards=tmp_path / "auto")
    sequential = client.generate(PROMPT, max_new_tokens=24, stop_ids=set(), strategy="sequential")
    for strategy in ("tree-nohead", "lookahead"):
        got = client.generate(PROMPT, max_new_tokens=24, stop_ids=set(), strategy=strategy)
        assert got.token_ids == sequential.token_ids, strategy


def test_weights_float32_is_one_flag_away(tiny_safetensors, tmp_path):
    manifest = _prepare(tiny_safetensors, tmp_path / "f32", "--weights", "float32")
    assert manifest["weights"] == {"local": "float32", "cloud": "float32", "lm_head": "float32"}
    assert "weights_reason" not in manifest
    cloud = load_file(str(tmp_path / "f32" / "cloud" / "weights.safetensors"))
    assert not any(k.endswith("qweight") for k in cloud)
    assert cloud["model.layers.1.mlp.down_proj.weight"].dtype == torch.float32


def test_a_gpu_cloud_is_prepared_in_bfloat16(tiny_safetensors, tmp_path):
    expected = _expected()
    manifest = _prepare(tiny_safetensors, tmp_path / "gpu", "--cloud-device", "cuda")
    assert manifest["weights"] == {**expected, "cloud": "bfloat16"}
