"""The integer weights a step streams, moved into one block of memory in the order the step reads them.

A decode step reads every weight once, so on a CPU its time is the bytes over the bandwidth one core reaches.
Each packed weight was its own allocation (4 KB pages scattered over the address space): the hardware
prefetchers restart at every product, and every 4 KB page is a TLB miss. Moved into one anonymous mapping,
2 MB aligned and advised for transparent huge pages (Linux's MADV_HUGEPAGE, where the kernel offers them),
the layers' products follow one another as one stream. Measured on SmolLM2's int8 shards, one core, both
copies of the model in one process and timed alternately: the cloud's step 1.11-1.18x faster at one to eight
rows, the local side's 1.18-1.24x, every output identical (notes/bench/arena, `splitinfer bench arena`).

Every tensor keeps its identity (`Tensor.set_`), so the modules and native calls that hold it read the new
memory; the old allocation is freed as each tensor moves. Where the OS has no anonymous mappings, the tensors
are not on the CPU, or SPLITINFER_ARENA=0 (for A/B runs: `splitinfer bench arena`), nothing moves.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

import torch
from torch import nn

from . import linears

ALIGN = 2 << 20  # a transparent huge page
ENV = "SPLITINFER_ARENA"  # 0: leave every weight where it was allocated
ORDER = ("fused_qkv", "q_proj", "k_proj", "v_proj", "o_proj", "fused_gate_up", "gate_proj", "up_proj", "down_proj")


def packed_weights(module: nn.Module) -> list[torch.Tensor]:
    """The packed weights of `module`'s integer products (model/w8a8.py's and model/w4a8.py's layouts), in the
    order a decoder layer runs them (ORDER; other products after, in module order)."""
    products = [(name.rsplit(".", 1)[-1], m) for name, m in module.named_modules() if isinstance(m, linears.QuantLinear)]
    products.sort(key=lambda item: ORDER.index(item[0]) if item[0] in ORDER else len(ORDER))
    found = []
    for _, product in products:
        w8a8, w4a8 = getattr(product, "_w8a8", None), getattr(product, "_w4a8", None)
        found += [w8a8[0]] if w8a8 is not None else [w4a8] if w4a8 is not None else []
    return found


def gather(tensors: list[torch.Tensor]) -> int:
    """Move `tensors` (CPU, contiguous, each once) into one mapping in this order, each at a 64-byte boundary.
    Returns the bytes moved (0 where nothing moves). The mapping lives as long as the tensors that view it."""
    if (not tensors or os.environ.get(ENV, "1") == "0" or not hasattr(mmap, "MAP_ANONYMOUS")
            or any(t.device.type != "cpu" for t in tensors)):
        return 0
    if len({t.data_ptr() for t in tensors}) != len(tensors) or not all(t.is_contiguous() for t in tensors):
        raise ValueError("arena.gather moves distinct contiguous tensors only.")
    sizes = [-(-t.nbytes // 64) * 64 for t in tensors]
    mapping = mmap.mmap(-1, sum(sizes) + ALIGN, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:  # before the first write: the pages are then huge from the start
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: one block of ordinary pages still serves
            pass
    block = torch.frombuffer(mapping, dtype=torch.uint8)  # the storage keeps the mapping alive
    offset = -block.data_ptr() % ALIGN
    for tensor, size in zip(tensors, sizes):
        view = block[offset : offset + tensor.nbytes]
        view.copy_(tensor.detach().reshape(-1).view(torch.uint8))
        tensor.set_(view.untyped_storage(), offset // tensor.element_size(), tensor.shape, tensor.stride())
        offset += size
    return sum(t.nbytes for t in tensors)


def return_freed() -> bool:
    """Hand the heap memory freed while a shard loaded back to the OS (glibc's `malloc_trim`): reading the file,
    quantized states packed, fused and gathered leave freed blocks that the allocator otherwise keeps for the
    process's life, as resident memory. True where it ran (a C library without it: nothing to do)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return False
    trim(0)
    return True
