"""kernels/build.py: the kernels are built wherever the CPU has their instructions, at an explicit moment,
with a line that says what runs instead where they cannot; and kernels/rms_norm.cpp computes transformers'
norm a row at a time, in the layers with integer products only."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch
import torch.nn.functional as F

from splitinfer import kernels
from splitinfer.errors import ConfigError
from splitinfer.kernels import build
from splitinfer.model.formats import WeightFormats
from splitinfer.model.fused import NativeRMSNorm, RMSNormCall
from splitinfer.model.prepare import prepare
from splitinfer.model.shards import load_cloud
from splitinfer.model.source import SourceModel
from tiny import tiny_model

needs_native = pytest.mark.skipif(not kernels.available(), reason="splitinfer's kernels do not run on this CPU")


def test_the_kernels_are_built_wherever_the_cpu_has_their_instructions():
    """No silent fallback on a machine that can run them (CI included): a build failure fails here."""
    if os.environ.get(build.ENV, "all") != "all":
        pytest.skip(f"{build.ENV} turns kernels off")
    assert kernels.available() == build.cpu_supports()
    assert set(kernels.report()) == set(build.KERNELS)
    assert build.layout()["w8a8_cols"] == 16 and build.layout()["w4a8_group"] == 32  # read back from the library


def test_a_failed_build_leaves_the_fallbacks_with_a_line_saying_so(monkeypatch, caplog):
    def no_compiler():
        raise OSError("g++: not found")

    state = build._State()
    monkeypatch.setattr(build, "_STATE", state)
    monkeypatch.setattr(build, "_load", no_compiler)
    monkeypatch.setattr(build, "cpu_supports", lambda: True)
    with caplog.at_level(logging.WARNING):
        assert build.ensure(build.KernelSet()) is False
    assert "do not run here: the build failed (OSError: g++: not found); PyTorch's kernels run instead" in caplog.text
    assert not build.runs("w8a8") and build.report()["w8a8"] == "fbgemm (quantized::linear)"


def test_a_killed_builds_lock_goes_and_a_fresh_one_stays(tmp_path, caplog):
    """PyTorch's loader waits for ever on the lock of a build that was killed; a lock as young as a build may be
    another process building now."""
    lock = tmp_path / "lock"
    lock.touch()
    assert not build.clear_stale_lock(tmp_path) and lock.exists()
    old = time.time() - build.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    with caplog.at_level("WARNING"):
        assert build.clear_stale_lock(tmp_path)
    assert not lock.exists() and "did not finish" in caplog.text
    assert not build.clear_stale_lock(tmp_path)  # none there: nothing to do


def test_turned_off_nothing_builds_and_available_never_builds(monkeypatch):
    state = build._State()
    monkeypatch.setattr(build, "_STATE", state)
    monkeypatch.setattr(build, "_load", lambda: pytest.fail("built although turned off"))
    assert build.available() is False  # asking never builds
    monkeypatch.setenv(build.ENV, "none")
    assert build.ensure() is False and "turned off" in build.status()["reason"]


def test_kernel_sets_parse_and_name_themselves():
    assert build.KernelSet.parse("all") == build.KernelSet()
    assert build.KernelSet.parse("all,-rms_norm") == build.KernelSet(rms_norm=False)
    assert build.KernelSet.parse("w8a8") == build.KernelSet(w4a8=False, rows_attention=False, rms_norm=False,
                                                            decoder_layer=False, row_top=False, amx=False)
    assert build.KernelSet.parse("none").spec() == "none"
    assert build.KernelSet(row_top=False).spec() == "all,-row_top"
    with pytest.raises(ConfigError, match="not a kernel"):
        build.KernelSet.parse("all,-fast")


def test_choosing_restores_the_set_before():
    before = kernels.report()
    with kernels.choosing(kernels.KernelSet.parse("none")):
        assert not any(kernels.runs(name) for name in build.KERNELS)
    assert kernels.report() == before


@needs_native
def test_rms_norm_is_transformers_norm_and_each_row_has_its_own_bits():
    torch.manual_seed(0)
    weight = torch.randn(576)
    x = torch.randn(2, 33, 576) * torch.logspace(-3, 3, 33)[None, :, None]
    ours = torch.ops.splitinfer.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(ours, F.rms_norm(x, (576,), weight, 1e-5), rtol=1e-5, atol=1e-6)
    flat = x.reshape(-1, 576)
    alone = torch.cat([torch.ops.splitinfer.rms_norm(flat[i : i + 1], weight, 1e-5) for i in range(len(flat))])
    assert torch.equal(alone, ours.reshape(-1, 576))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.splitinfer.rms_norm(torch.randn(3, 40), torch.randn(40), 1e-5)


@needs_native
@pytest.mark.parametrize("weights, norm", [("int4", NativeRMSNorm), ("float32", RMSNormCall)])
def test_only_layers_with_integer_products_take_the_native_norm(tmp_path, weights, norm):
    """A float32 layer keeps transformers' bits (F.rms_norm where its probe matched them), never ours."""
    model = tiny_model("llama")
    shards = tmp_path / weights
    prepare(SourceModel("tiny-llama", model.config, model, None), shards, 1, 1, "float32",
            weights=WeightFormats.parse(weights))
    norms = [m for m in load_cloud(shards / "cloud").stack.modules() if isinstance(m, (RMSNormCall, NativeRMSNorm))
             or type(m).__name__.endswith("RMSNorm")]
    assert norms and all(isinstance(m, norm) for m in norms)
    other = RMSNormCall if norm is NativeRMSNorm else NativeRMSNorm
    assert not any(isinstance(m, other) for m in norms)


@needs_native
@pytest.mark.parametrize("weights, norm", [("int8,lm_head=int8", NativeRMSNorm), ("int8,lm_head=float32", RMSNormCall)])
def test_the_final_norm_takes_the_native_kernel_before_an_integer_lm_head_only(tmp_path, weights, norm):
    """An int8 LM head quantizes its input anyway: the norm before it runs as one native call; before a float
    head the norm keeps transformers' bits. Training through it (a draft head's readout) keeps a gradient."""
    from splitinfer.model.shards import load_local

    model = tiny_model("llama")
    shards = tmp_path / "shards"
    prepare(SourceModel("tiny-llama", model.config, model, None), shards, 1, 1, "float32",
            weights=WeightFormats.parse(weights))
    final = load_local(shards / "local").norm
    assert isinstance(final, norm)
    x = torch.randn(3, model.config.hidden_size, requires_grad=True)
    y = final(x)
    assert y.grad_fn is not None  # never the kernel, which has no gradient
    with torch.no_grad():
        expected = torch.ops.splitinfer.rms_norm(x, final.weight, final.variance_epsilon) if norm is NativeRMSNorm else y
        assert torch.equal(final(x.detach()), expected)
