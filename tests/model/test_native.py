"""model/native.py: splitinfer's CPU kernels are built wherever the CPU has their instructions, and its RMS
norm computes transformers' norm a row at a time, in the layers with integer products only."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from splitinfer.model import native
from splitinfer.model.formats import WeightFormats
from splitinfer.model.fused import NativeRMSNorm, RMSNormCall
from splitinfer.model.prepare import prepare
from splitinfer.model.shards import load_cloud
from splitinfer.model.source import SourceModel
from tiny import tiny_model

needs_native = pytest.mark.skipif(not native.available(), reason="model/native.py's kernels do not run on this CPU")


def test_the_kernels_are_built_wherever_the_cpu_has_their_instructions():
    """No silent fallback on a machine that can run them (CI included): a build failure fails here."""
    if os.environ.get(native.ENV) == "0":
        pytest.skip(f"{native.ENV}=0 turns the kernels off")
    assert native.available() == native.cpu_supports()
    names = native.kernel_names()
    assert set(names) == {"int4", "int8", "exact_rows_attention", "integer_layer_norms", "integer_layers",
                          "recycling_top_k"}


def test_a_failed_build_or_the_switch_leaves_pytorchs_kernels_with_a_warning(monkeypatch, caplog):
    def no_compiler():
        raise OSError("g++: not found")

    monkeypatch.setattr(native, "_build", no_compiler)
    monkeypatch.setattr(native, "cpu_supports", lambda: True)
    assert native._usable() is False
    assert "could not be built (g++: not found); using PyTorch's kernels instead" in caplog.text
    monkeypatch.setenv(native.ENV, "0")
    monkeypatch.setattr(native, "_build", lambda: pytest.fail("built although turned off"))
    assert native._usable() is False


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
    norms = [m for m in load_cloud(shards / "cloud").stack.modules() if type(m).__name__.endswith("RMSNorm")]
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
        expected = torch.ops.splitinfer.rms_norm(x, final._weight, final._eps) if norm is NativeRMSNorm else y
        assert torch.equal(final(x.detach()), expected)
