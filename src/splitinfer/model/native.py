"""splitinfer's own CPU kernels, built once per machine with PyTorch's C++ extension tools.

Five kernels, each where no maintained library kernel serves (the measurements are in their files): w4a8.cpp
(model/w4a8.py: int4 weights times int8 activations), w8a8.cpp (model/w8a8.py: int8 weights, many rows),
rows_attention.cpp (model/attention.py: attention whose rows do not depend on the block around them),
rms_norm.cpp (model/fused.py: the RMS norms of layers with integer products, one pass a row) and row_top.cpp
(decoding/sources.py: Token Recycling's top-k successors and their softmax probabilities, two passes a row); and
decoder_layer.cpp, which runs them back to back as one call a decoder layer, or every layer of a stack for a lone
block (model/native_layer.py). They need
AVX512 (F, BW, VL, VNNI) and F16C, and a C++ compiler; the first use builds them (about 25 s on this 2-core
machine) into PyTorch's extension cache (TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions), later starts
load them in a fraction of a second.

`available()` says whether they run here. Where they do not (another CPU, no compiler, or
SPLITINFER_NATIVE=0), int4 and exact-rows attention keep PyTorch's kernels and int8 FBGEMM's: the same
exactness, other rounding (int8 the same bits), so a model's text may differ where two logits are within
rounding, as between any two kernels.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c")
SOURCES = [Path(__file__).with_name(name) for name in (
    "w4a8.cpp", "w8a8.cpp", "rows_attention.cpp", "rms_norm.cpp", "decoder_layer.cpp", "row_top.cpp")]
HEADER = Path(__file__).with_name("native.h")  # what the sources share (its hash is a flag: a change rebuilds)
CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma", "-ffp-contract=off"]
ENV = "SPLITINFER_NATIVE"  # 0: never build or use the kernels


def cpu_flags() -> set[str]:
    """This CPU's feature flags (Linux's /proc/cpuinfo; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


def cpu_supports() -> bool:
    """Whether this CPU has the instructions the kernels are built for."""
    return set(CPU_FLAGS) <= cpu_flags()


@functools.cache
def available() -> bool:
    """Whether the kernels run here; builds them on the first call of a machine (once a process)."""
    return _usable()


def _usable() -> bool:
    if os.environ.get(ENV, "1") == "0" or not cpu_supports():
        return False
    try:
        _build()
    except Exception as exc:  # no compiler, no ninja, headers missing: PyTorch's kernels serve instead
        log.warning("splitinfer's CPU kernels could not be built (%s); using PyTorch's kernels instead", exc)
        return False
    return True


def _build() -> None:
    from torch.utils import cpp_extension

    start = time.perf_counter()
    header = hashlib.sha256(HEADER.read_bytes()).hexdigest()[:16]
    cpp_extension.load(name="splitinfer_native", sources=[str(s) for s in SOURCES],
                       extra_cflags=[*CFLAGS, f"-DSPLITINFER_HEADER={header}"], is_python_module=False, verbose=False)
    if time.perf_counter() - start > 5:
        log.info("built splitinfer's CPU kernels in %.0f s (cached for the next start)", time.perf_counter() - start)

    @torch.library.register_fake("splitinfer::w4a8_mm")
    def _(x, packed, n):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("splitinfer::w8a8_mm")
    def _(xq, packed, column_sums, scale, row_scale=None, prefetch=0):
        return xq.new_empty(xq.shape[0], column_sums.shape[0])

    @torch.library.register_fake("splitinfer::w8a8_linear")
    def _(x, packed, column_sums, scale, smooth=None, bias=None):
        return x.new_empty(x.shape[0], column_sums.shape[0])

    @torch.library.register_fake("splitinfer::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.register_fake("splitinfer::rows_attention")
    def _(query, key, value, index, offsets, scale):
        return query.new_empty(query.shape[1], query.shape[0], query.shape[2])

    @torch.library.register_fake("splitinfer::decoder_layer")
    def _(hidden, cos, sin, key_cache, value_cache, start, index, offsets, weights, heads, kv_heads, eps, scale):
        return torch.empty_like(hidden)

    @torch.library.register_fake("splitinfer::row_top")
    def _(logits, k):
        return logits.new_empty(logits.shape[0], k, dtype=torch.long), logits.new_empty(logits.shape[0], k)


def kernel_names() -> dict[str, str]:
    """Which kernels run here, as reports name them."""
    if available():
        return {"int4": "w4a8 (model/w4a8.py)", "int8": "w8a8 (model/w8a8.py)",
                "exact_rows_attention": "rows_attention (model/attention.py)",
                "integer_layer_norms": "rms_norm (model/fused.py)",
                "integer_layers": "decoder_layer (model/native_layer.py)",
                "recycling_top_k": "row_top (decoding/sources.py)"}
    return {"int4": "pytorch (_weight_int4pack_mm_for_cpu)", "int8": "fbgemm (quantized::linear)",
            "exact_rows_attention": "pytorch (SDPA a row)", "integer_layer_norms": "pytorch (F.rms_norm)",
            "integer_layers": "python (model/fastpath.py)", "recycling_top_k": "pytorch (softmax + topk)"}
