"""Keep long-running processes (`serve`, `api`) at a flat memory: freed memory back to the OS, caches capped.

glibc's malloc serves blocks of 128 KiB and more with mmap, but it raises that threshold each time such a
block is freed (up to 32 MiB), so after a while the KV buffers and activations of finished sessions are
carved from the heap, where a free block in the middle is not returned. In the 30-minute soak of
notes/bench/soak that showed as a cloud server's resident memory rising in steps, ~6 MiB a minute, with
sessions and cached rows flat; with the threshold fixed at 128 KiB (what glibc starts with) the same load
stayed within noise (docs/security.md, "Soak"). Fixing the threshold is all this does: memory is still
reused within the process, and blocks under 128 KiB are unaffected.

oneDNN (model/rows.py runs products of four rows and more through it) builds a primitive, with its JIT
code and scratch buffers, for every weight shape and row count it meets, and keeps them in two caches of
1,024 entries each: its own primitive cache and the one of PyTorch's ideep layer. A server batching
sessions into one pass meets a new total row count every so often, so it grew ~0.4 MiB per new count and
shape until both caches filled (~450 MiB): the steady ~1.3-1.6 MiB a minute of the 60-minute soak
(notes/bench/soak/3-60min). `cap_kernel_caches` sets both capacities (`LRU_CACHE_CAPACITY`,
`ONEDNN_PRIMITIVE_CACHE_CAPACITY`) to 64 entries: 16 row counts of a layer's four weight shapes, which a
decode loop's few row counts fit. A count outside them rebuilds its primitive, about 0.15 ms a product
shape on this machine, and memory stays bounded (~25 MiB). Both are read when oneDNN is first used, so
the call must come before the first product; a user's own setting is kept.

`heap()` reads what the allocators hold, so a soak can tell a leak (memory in use grows) from memory kept
by the allocator (free bytes grow, in use stays flat): glibc's mallinfo2 and CPython's count of allocated
object blocks. Both are exported on each side's /metrics (metrics.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's initial threshold, kept from then on
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
_ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc's own setting: a user who set it keeps theirs


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes; False where there is no glibc (or the user set it)."""
    if _ENV in os.environ:
        return False
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to do
        mallopt = None
    if mallopt is None:
        return False
    done = bool(mallopt(_M_MMAP_THRESHOLD, threshold))
    log.debug("malloc mmap threshold fixed at %d bytes: %s", threshold, done)
    return done


KERNEL_CACHE_ENTRIES = 64  # per cache; 16 row counts x a decoder layer's 4 weight shapes
_CACHE_ENVS = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")  # ideep's cache, oneDNN's own


def cap_kernel_caches(entries: int = KERNEL_CACHE_ENTRIES) -> list[str]:
    """Cap oneDNN's and ideep's caches of built products at `entries` each; returns the settings made
    (a user's own are kept). Effective only before this process's first oneDNN product."""
    made = [name for name in _CACHE_ENVS if name not in os.environ]
    for name in made:
        os.environ[name] = str(entries)
    log.debug("kernel caches capped at %d entries: %s", entries, made)
    return made


def settle_long_running() -> None:
    """What a long-running process sets first: the mmap threshold and the kernel caches' capacity."""
    fix_mmap_threshold()
    cap_kernel_caches()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2():
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).mallinfo2 if name else None  # glibc 2.33 and later
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _mallinfo2()


def heap() -> dict:
    """{"in_use_bytes", "free_bytes"}: what glibc's malloc has handed out (heap blocks + mmapped blocks) and
    what it holds free (both 0.0 without glibc 2.33+), and "python_blocks": CPython's allocated blocks."""
    info = _MALLINFO2() if _MALLINFO2 is not None else None
    in_use = float(info.uordblks + info.hblkhd) if info is not None else 0.0
    free = float(info.fordblks) if info is not None else 0.0
    return {"in_use_bytes": in_use, "free_bytes": free, "python_blocks": float(sys.getallocatedblocks())}
