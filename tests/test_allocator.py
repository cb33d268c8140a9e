"""The allocator setting of long-running processes: glibc's mmap threshold fixed, a user's own setting kept."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import subprocess
import sys

import pytest

from splitinfer import allocator
from splitinfer.model.rows import ONEDNN


def _glibc() -> bool:
    name = ctypes.util.find_library("c")
    return bool(name) and hasattr(ctypes.CDLL(name), "gnu_get_libc_version")


@pytest.mark.skipif(not _glibc(), reason="mallopt's mmap threshold is glibc's")
def test_a_freed_large_block_goes_back_to_the_os():
    """After the threshold is fixed, a freed block above it is unmapped: resident memory falls back. Without it,
    glibc raises the threshold on the first such free and keeps the second block in the heap."""
    script = """
import sys, torch
from splitinfer import allocator
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'): return int(line.split()[1]) // 1024
fix = sys.argv[1] == 'fix'
if fix: assert allocator.fix_mmap_threshold()
for _ in range(2):  # the first free raises glibc's dynamic threshold; the second block then comes from the heap
    before = rss(); x = torch.ones(8 * 2**20 // 4); grown = rss() - before; del x; kept = rss() - before
print(grown, kept)
"""
    for mode, held in (("fix", False), ("default", True)):
        out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, check=True,
                             env={"PATH": "/usr/bin:/bin"}).stdout.split()
        grown, kept = int(out[0]), int(out[1])
        assert grown >= 7, out  # the 8 MiB block was touched
        assert (kept >= 7) == held, (mode, out)


def test_a_users_own_setting_is_kept(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert allocator.fix_mmap_threshold() is False


@pytest.mark.skipif(not _glibc(), reason="mallinfo2 is glibc's")
def test_heap_counts_what_malloc_has_handed_out_and_python_blocks():
    import torch

    before = allocator.heap()
    x = torch.ones(16 * 2**20 // 4)  # 16 MiB from malloc (torch's CPU allocator)
    during = allocator.heap()
    del x
    after = allocator.heap()
    assert during["in_use_bytes"] - before["in_use_bytes"] >= 15 * 2**20
    assert during["in_use_bytes"] - after["in_use_bytes"] >= 15 * 2**20
    assert after["python_blocks"] > 0 and after["free_bytes"] >= 0


def test_both_sides_export_the_heap_on_metrics():
    from splitinfer.metrics import HEAP_GAUGES, LocalMetrics

    text = LocalMetrics().render().decode()
    for name, _ in HEAP_GAUGES.values():
        assert name in text


@pytest.mark.skipif(not (_glibc() and ONEDNN), reason="oneDNN's caches, read with mallinfo2")
def test_capped_kernel_caches_keep_memory_bounded_over_many_row_counts():
    """Each row count a packed product meets builds and caches a primitive: 120 row counts grow malloc's bytes
    in use by tens of MiB under the default capacities and stay near flat under the cap (the servers' leak of
    the 60-minute soak)."""
    script = """
import sys, torch
from splitinfer import allocator
from splitinfer.model.rows import pack, packed_linear
if sys.argv[1] == 'cap': assert allocator.cap_kernel_caches(16) == list(allocator._CACHE_ENVS)
torch.set_num_threads(1)
w = pack(torch.randn(1536, 576))
packed_linear(torch.randn(4, 576), w, None)
before = allocator.heap()['in_use_bytes']
for rows in range(5, 125):
    packed_linear(torch.randn(rows, 576), w, None)
print((allocator.heap()['in_use_bytes'] - before) / 2**20)
"""
    grown = {}
    for mode in ("cap", "default"):
        out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, check=True,
                             env={"PATH": "/usr/bin:/bin"}).stdout.split()
        grown[mode] = float(out[-1])
    assert grown["default"] > 20 and grown["cap"] < 10, grown


def test_a_users_own_cache_capacity_is_kept(monkeypatch):
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "8")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    assert allocator.cap_kernel_caches() == ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]
    assert os.environ["LRU_CACHE_CAPACITY"] == "8"
