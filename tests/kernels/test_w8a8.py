"""kernels/w8a8.py: the int8 kernel gives torch._int_mm's and FBGEMM's bits, and each row its own."""

from __future__ import annotations

import pytest
import torch

from splitinfer import kernels

from splitinfer.kernels import w8a8
from splitinfer.model import formats, linears
from splitinfer.model.linears import fbgemm_pack, int8_product, int_mm_product

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="this CPU has no AVX512-VNNI (or the kernel could not be built)")
needs_amx = pytest.mark.skipif(not kernels.runs("amx"), reason="this CPU (or Linux) gives this process no AMX-INT8 tiles")
PATHS = [pytest.param(False, id="vnni"), pytest.param(True, id="amx", marks=needs_amx)]


@pytest.fixture
def path(request):
    """Run the test with the int8 product's AMX path on or off (process-wide), then put it back on."""
    kernels.build.use_amx(request.param)
    yield request.param
    kernels.build.use_amx(True)


def integers(rows: int, k: int, seed: int) -> torch.Tensor:
    """Quantized inputs as Int8Linear makes them, with the extremes -127 and 127 in every row."""
    x = torch.randint(-127, 128, (rows, k), generator=torch.Generator().manual_seed(seed)).float()
    x[:, 0], x[:, -1] = -127, 127
    return x


@needs_kernel
@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("n, k", [(16, 4), (48, 64), (192, 576), (576, 1536), (1040, 576), (80, 100)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 14, 16, 17, 33])
def test_the_kernel_gives_int_mm_and_fbgemm_bits(path, n, k, rows):
    """Shapes with 1-4 tiles left over after the groups of four, and inputs in whole chunks of 64 or not (100: a
    chunk and a short one; AMX takes whole chunks only); one to four rows (one pass of four), five and six (one
    pass of six), seven and eight (pairs of tiles), alone or after blocks of eight; on AMX, passes of sixteen."""
    torch.manual_seed(0)
    state = formats.quantize_int8(torch.randn(n, k))
    qweight, scale = state["qweight"], state["scale"]
    qweight[0, :] = -127  # a column whose sum is the most negative one
    xq = integers(rows, k, seed=rows)
    ours = w8a8.matmul(xq, *w8a8.pack(qweight), scale.contiguous())
    assert torch.equal(ours, int_mm_product(xq, qweight.t(), scale[None, :]))
    packed = fbgemm_pack(qweight, scale)
    if packed is not None:
        assert torch.equal(ours, int8_product(xq, packed))
    sx = torch.rand(rows) + 0.5
    assert torch.equal(w8a8.matmul(xq, *w8a8.pack(qweight), scale.contiguous(), sx), ours * sx[:, None])
    assert torch.equal(w8a8.matmul(xq, *w8a8.pack(qweight), scale.contiguous(), prefetch=16384), ours)  # the A/B knob


@needs_kernel
@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("threads", [1, 2])
def test_every_row_has_the_bits_it_has_alone(path, threads):
    torch.manual_seed(1)
    state = formats.quantize_int8(torch.randn(1024, 576))
    packed = w8a8.pack(state["qweight"])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        xq = integers(64, 576, seed=2)
        alone = torch.cat([w8a8.matmul(xq[i : i + 1], *packed, state["scale"]) for i in range(64)])
        blocks = {m: w8a8.matmul(xq[:m], *packed, state["scale"]) for m in [*range(2, 13), 64]}
    finally:
        torch.set_num_threads(before)
    for m, block in blocks.items():  # every kernel path: one to four rows, six, pairs of tiles, blocks and their rest
        assert torch.equal(block, alone[:m]), m


def test_fbgemm_is_probed_on_the_cpu_even_when_first_asked_on_the_meta_device():
    """Loading builds a shard's skeleton on the meta device and chooses each module's kernel there: a probe run
    there failed, and the cached answer sent every later int8 layer to torch._int_mm instead of FBGEMM."""
    on_cpu = linears.fbgemm_works.__wrapped__()
    with torch.device("meta"):
        assert linears.fbgemm_works.__wrapped__() == on_cpu


@needs_kernel
def test_int8_linears_take_the_kernel_where_their_shape_tiles():
    assert linears.kernel_class("int8", 64, 40) is linears.FbgemmLinear  # 40 output columns: not whole tiles
    assert linears.kernel_class("int8", 64, 48) is linears.W8A8Linear
    even = linears.W8A8Linear(64, 48)
    stored = formats.quantize_int8(torch.randn(48, 64))
    even.load_state_dict(stored)
    even.finish()
    # the tiles are the one copy: the [N, K] buffer is released, and what the shard stores reads back whole
    assert even.qweight is None
    assert torch.equal(even.stored_state()["qweight"], stored["qweight"])
    assert torch.equal(even.weight, formats.dequantize(stored))
    even.finish()  # finishing again changes nothing
    assert even.qweight is None and torch.equal(even.int8_weight(), stored["qweight"])
    x = torch.randn(5, 64)
    with kernels.choosing(kernels.KernelSet(w8a8=False)):
        assert linears.kernel_class("int8", 64, 48) is linears.FbgemmLinear
    for library_class in (linears.FbgemmLinear, linears.IntMMLinear):  # the same bits on every kernel
        library = library_class(64, 48)
        library.load_state_dict(even.stored_state())
        library.finish()
        assert library.qweight is not None and torch.equal(even(x), library(x)), library_class


@pytest.mark.parametrize("n, k", [(64, 4), (48, 64), (576, 576), (200, 36), (64, 200)])
def test_unpack_is_packs_inverse(n, k):
    weight = torch.randint(-127, 128, (n, k), generator=torch.Generator().manual_seed(n), dtype=torch.int8)
    assert torch.equal(w8a8.unpack(w8a8.pack(weight)[0], n), weight)


@needs_kernel
def test_bad_operands_are_refused_with_what_was_expected():
    packed, sums = w8a8.pack(torch.zeros(32, 64, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="does not match packed"):
        w8a8.matmul(torch.zeros(2, 60), packed, sums, torch.ones(32))
    with pytest.raises(RuntimeError, match="an entry for each of the 32 columns"):
        w8a8.matmul(torch.zeros(2, 64), packed, sums, torch.ones(16))


@needs_kernel
def test_the_int8_dot_product_peak_is_a_rate():
    """bench step's integer compute bound: GOP/s of vpdpbusd, measured on torch's threads (a plausible range)."""
    peak = torch.ops.splitinfer.int8_dot_peak(200_000)
    assert 10 < peak < 10_000 * torch.get_num_threads()


@needs_amx
def test_the_amx_peak_is_a_rate_above_vnnis():
    """The AMX path's compute bound: tdpbusd's GOP/s, measured; a tile product does 16 x 16 x 64 multiply-adds."""
    amx, vnni = torch.ops.splitinfer.amx_peak(20_000), torch.ops.splitinfer.int8_dot_peak(200_000)
    assert vnni < amx < 100_000 * torch.get_num_threads()


@needs_kernel
def test_amx_is_chosen_process_wide_and_reported():
    assert kernels.build.use_amx(False) is False
    try:
        assert torch.ops.splitinfer.amx(False) == kernels.build._STATE.amx  # the CPU's answer, whatever the choice
    finally:
        kernels.build.use_amx(True)
    assert kernels.runs("amx") == kernels.build._STATE.amx
    with kernels.choosing(kernels.KernelSet.parse("all,-amx")):
        assert not kernels.runs("amx") and kernels.report()["amx"] == kernels.KERNELS["amx"][1]
    assert kernels.runs("amx") == kernels.build._STATE.amx


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 8, 11])
@pytest.mark.parametrize("extras", [(), ("smooth",), ("bias",), ("smooth", "bias")])
def test_the_one_call_linear_gives_quantize_product_and_bias_composed(rows, extras):
    """Int8Linear's forward on the kernel (w8a8.linear) against its steps taken one by one."""
    torch.manual_seed(rows)
    state = formats.quantize_int8(torch.randn(192, 576))
    packed, scale = w8a8.pack(state["qweight"]), state["scale"].contiguous()
    x = torch.randn(rows, 576) * 3
    x[0, 5] = 0.0
    smooth = torch.rand(576) + 0.5 if "smooth" in extras else None
    bias = torch.randn(192) if "bias" in extras else None
    xq, sx = linears.quantize_rows(x * smooth if smooth is not None else x.clone())
    composed = w8a8.matmul(xq, *packed, scale, sx.reshape(-1))
    composed = composed + bias if bias is not None else composed
    assert torch.equal(w8a8.linear(x, *packed, scale, smooth, bias), composed)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        w8a8.linear(x, *packed, scale, smooth, torch.zeros(5))
