"""bench/kernel_ab.py: each kernel on and off, the sets built as loading builds them, timed in alternating rounds,
compared bit for bit and stored; a comparison whose sets build the same modules is named, not timed."""

import json

import pytest

from splitinfer import kernels
from splitinfer.bench import kernel_ab
from splitinfer.cli import main
from splitinfer.errors import ConfigError
from splitinfer.model.formats import WeightFormats
from splitinfer.model.prepare import prepare
from splitinfer.model.source import SourceModel
from tiny import tiny_model

pytestmark = pytest.mark.skipif(not kernels.ensure(), reason="splitinfer's kernels do not run on this CPU")


def _int8_shards(tmp_path):
    model = tiny_model("llama", 0)
    out = tmp_path / "int8"
    prepare(SourceModel("tiny-llama", model.config, model, None), out, 1, 1, "float32", weights=WeightFormats.parse("int8"))
    return out


def test_every_set_is_timed_against_all_and_stored(tmp_path):
    shards = _int8_shards(tmp_path)
    argv = ["bench", "kernel-ab", "--shards", str(shards), "--out", str(tmp_path / "out"), "--kernels",
            "w8a8,w4a8,decoder_layer", "--rows", "1,3", "--context", "5", "--repeats", "2", "--warmup", "1", "--cpu", "-1"]
    assert main(argv) == 0
    report = json.loads((tmp_path / "out" / "kernel_ab.json").read_text())
    assert report["command"].startswith("splitinfer bench kernel-ab") and report["provenance"]["commit"] is not None
    assert report["not_run"] == ["w4a8"]  # an int8 shard has no int4 product
    assert {r["kernel"] for r in report["rows"]} == {"w8a8", "decoder_layer", "none"}
    assert len(report["rows"]) == 3 * 2 * 2  # comparisons x sides x block sizes
    modules = report["modules"]
    assert set(modules) == {"all", "all,-decoder_layer", "all,-decoder_layer,-w8a8", "none"}
    assert any("W8A8Linear" in name for name in modules["all,-decoder_layer"])
    assert not any("W8A8Linear" in name for name in modules["all,-decoder_layer,-w8a8"])
    assert any("NativeLayer" in name for name in modules["all"])
    assert not any("NativeLayer" in name for name in modules["all,-decoder_layer"])
    for r in report["rows"]:
        assert r["on_ms"] > 0 and r["off_ms"] > 0 and r["x_off"] > 0
        if r["kernel"] in ("w8a8", "decoder_layer"):  # these kernels give the library path's bits
            assert r["identical"], r
    assert set(report["gains"]) == {"w8a8", "decoder_layer", "none"}
    assert "| w8a8 | all,-decoder_layer | all,-decoder_layer,-w8a8 | cloud | 1 |" in (tmp_path / "out" / "kernel_ab.md").read_text()


def test_an_unknown_kernel_is_refused_with_the_names():
    with pytest.raises(ConfigError, match="rms_norm"):
        kernel_ab.comparisons(["fast_path"])
    assert kernel_ab.comparisons(["row_top"]) == {"row_top": ("all", "all,-row_top"), "none": ("all", "none")}
