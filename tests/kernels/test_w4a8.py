"""kernels/w4a8.py: the int4 kernel on int8 activations computes its stated math, row by row the same bits
whatever else is in the call, and is built wherever the CPU has its instructions."""

from __future__ import annotations

import pytest
import torch

from splitinfer import kernels

from splitinfer.kernels import w4a8
from splitinfer.model import formats, linears

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="this CPU has no AVX512-VNNI (or the kernel could not be built)")


def _state(n: int, k: int, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return formats.quantize(torch.randn(n, k) * 0.05, "int4")


@needs_kernel
@pytest.mark.parametrize("n, k", [(16, 32), (48, 64), (960, 576), (576, 1536)])
def test_the_product_is_the_stated_math(n, k):
    """Against float64 PyTorch doing the same steps (int8 blocks of 32, exact integer sums): float32
    rounding apart, the same numbers; and near the float32 product of the weight it stands for."""
    state = _state(n, k)
    packed = w4a8.pack(state["qweight"], state["scale"], state["min"])
    x = torch.randn(9, k) * 2
    x[3] = 0  # a block of zeros has no scale: its products are zero, not NaN
    x[4, :32] = 1e-30
    y = w4a8.matmul(x, packed, n)
    ref = w4a8.reference(x, state["qweight"], state["scale"], state["min"])
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.all(y[3] == 0)
    exact = x @ formats.dequantize(state).t()
    assert (y - exact).abs().max() < 0.02 * exact.abs().max()


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_every_row_has_the_bits_it_has_alone_at_1_to_64_rows(threads):
    n, k = 960, 576
    state = _state(n, k, seed=1)
    packed = w4a8.pack(state["qweight"], state["scale"], state["min"])
    x = torch.randn(64, k) * 3
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([w4a8.matmul(x[i : i + 1], packed, n) for i in range(64)])
        for rows in range(1, 65):
            assert torch.equal(w4a8.matmul(x[:rows], packed, n), alone[:rows]), rows
            assert torch.equal(w4a8.matmul(x[64 - rows :], packed, n), alone[64 - rows :]), rows
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_int4_linear_takes_the_kernel_and_keeps_its_bias_and_dtype():
    state = _state(64, 96)
    state["bias"] = torch.randn(64)
    module = linears.W4A8Linear(96, 64, bias=True)
    module.load_state_dict(state)
    module.finish()
    assert module._w4a8 is not None
    x = torch.randn(2, 3, 96)
    y = module(x)
    assert y.shape == (2, 3, 64) and y.dtype == torch.float32
    expected = w4a8.matmul(x.reshape(6, 96), module._w4a8, 64) + state["bias"]
    assert torch.equal(y.reshape(6, 64), expected)
    assert module(x.to(torch.bfloat16)).dtype == torch.bfloat16


@needs_kernel
def test_a_mismatched_operand_is_refused_with_the_shapes():
    state = _state(32, 64)
    packed = w4a8.pack(state["qweight"], state["scale"], state["min"])
    with pytest.raises(RuntimeError, match="does not match packed"):
        w4a8.matmul(torch.randn(2, 96), packed, 32)
    with pytest.raises(RuntimeError, match="float32"):
        w4a8.matmul(torch.randn(2, 64).double(), packed, 32)


def test_widths_the_kernel_cannot_tile_take_pytorchs_kernel(monkeypatch):
    """An output width that is not a multiple of 16 (or the kernel turned off) keeps PyTorch's int4 kernel."""
    assert not w4a8.supports_shape(40, 64) and w4a8.supports_shape(48, 64)
    assert linears.kernel_class("int4", 64, 40) is linears.TorchInt4Linear
    with kernels.choosing(kernels.KernelSet(w4a8=False)):
        assert linears.kernel_class("int4", 64, 48) is linears.TorchInt4Linear
    module = linears.TorchInt4Linear(64, 48)
    module.load_state_dict(_state(48, 64))
    module.finish()
    assert module(torch.randn(3, 64)).shape == (3, 48)


def test_int4_scales_are_float16_as_in_a_gguf():
    """quantize_int4 rounds d and m to float16, so the weight the state stands for is what the kernel uses."""
    state = _state(32, 64)
    for name in ("scale", "min"):
        assert torch.equal(state[name], state[name].half().float()), name
