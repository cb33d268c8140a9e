"""splitinfer's own CPU kernels: the C++ sources, the header they share, their build and their fallbacks.

    build.py          when and where the library builds (`ensure`), which kernels run (`runs`, KernelSet)
    layout.h          the integer weights' packing layout and the one exp polynomial, shared by the sources
    library.cpp       the op library and `layout`, which Python reads the packing layout back from
    w8a8.cpp/.py      int8 weights times int8 activations (Python: packing, the op's call)
    w8a8_amx.cpp      the same product on AMX tiles, where the CPU has AMX-INT8 (and its peak, amx_peak)
    w4a8.cpp/.py      int4 weights (groups of 32) times int8 activations
    rows_attention.cpp  attention whose rows do not depend on each other (model/attention.py calls it)
    rms_norm.cpp      the RMS norm of integer layers, one pass a row
    decoder_layer.cpp a whole integer decoder layer, or a stack of them, as one call (model/native_layer.py)
    row_top.cpp       Token Recycling's top-k successors with their probabilities (decoding/sources.py)
    probe.cpp         not a kernel: the VNNI int8 dot-product peak `bench step` bounds integer products with

This package knows nothing of models, shards or steps: model/ and decoding/ choose a kernel per module,
once, when they construct it.
"""

import importlib

__all__ = ["KERNELS", "KernelSet", "available", "choosing", "ensure", "report", "runs", "status"]


def __getattr__(name: str):
    """build.py's names, imported on first use: `splitinfer kernels --help` and the CLI import no torch."""
    build = importlib.import_module(".build", __name__)
    if name == "build":
        return build
    if name in __all__:
        return getattr(build, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
