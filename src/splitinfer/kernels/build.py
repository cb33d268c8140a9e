"""Build, load and choose splitinfer's CPU kernels: once per install, at a moment the user sees.

The sources are the .cpp files beside this module; layout.h holds what they share (the packing layout of
the integer weights, read back by `layout()`, and the one exp polynomial). They need a C++ compiler and a
CPU with AVX-512 (F, BW, VL, VNNI) and F16C, read from Linux's /proc/cpuinfo (so never on macOS or ARM); the
int8 product moves onto AMX tiles where the CPU has AMX-INT8 (`use_amx`).

When they build: `ensure()` builds them on an install's first call (about a minute on 2 cores) into PyTorch's
extension cache (`$TORCH_EXTENSIONS_DIR`, else ~/.cache/torch_extensions; a directory per installed copy of
the sources) and loads them, in a fraction of
a second, on every later start. It is called by `splitinfer kernels`, by `prepare`, and whenever a shard is
loaded (the start of `serve` and of every client command), each time with one log line saying what
happened. Nothing else builds: `available()` only says whether the library is loaded in this process, so a
decode step never compiles.

Which kernels run: every one this machine can run, unless `SPLITINFER_KERNELS` names fewer ('none', or
'all,-rms_norm' to turn one off: what `bench step --kernels` compares). A module asks `runs(name)` once, when
it is constructed. What runs instead is each kernel's `FALLBACK`: FBGEMM's int8 product, PyTorch's int4
product, PyTorch's attention and norms, transformers' layer; the same exactness (rows stay independent of
each other), other rounding (int8 the same bits), so a model's text may differ where two logits are within
rounding, as between any two kernels.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from ..errors import ConfigError

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = sorted(HERE.glob("*.cpp"))
HEADER = HERE / "layout.h"
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c")
CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma", "-ffp-contract=off",
          "-fopenmp", "-mamx-tile", "-mamx-int8"]
# -fopenmp is what makes at::parallel_for parallel (ATen's header runs the loop serially without it) and links
# libgomp.so.1, the OpenMP runtime torch already loaded from torch/lib, so torch.set_num_threads governs both.
# -mamx-tile -mamx-int8 (GCC 11 or newer) let w8a8_amx.cpp name the tile instructions; they run only where the CPU
# reports AMX-INT8 and Linux grants the tile state, checked at the first product (else the VNNI loops run).
LDFLAGS = ["-fopenmp"]
NAME = "splitinfer_native"
ENV = "SPLITINFER_KERNELS"

# {kernel: (what it does, what runs where it does not)}; the names `runs` and SPLITINFER_KERNELS take.
KERNELS = {
    "w8a8": ("int8 weights times int8 activations (kernels/w8a8.py)", "fbgemm (quantized::linear)"),
    "w4a8": ("int4 weights times int8 activations (kernels/w4a8.py)", "pytorch (_weight_int4pack_mm_for_cpu)"),
    "rows_attention": ("attention whose rows do not depend on each other", "pytorch (SDPA a row)"),
    "rms_norm": ("the RMS norms of integer layers, one pass a row", "pytorch (F.rms_norm)"),
    "decoder_layer": ("a whole integer decoder layer, or stack, as one call", "python (model/layers.py)"),
    "row_top": ("Token Recycling's top-k successors and their probabilities", "pytorch (softmax + topk)"),
    "amx": ("w8a8's products on AMX tiles, where the CPU has AMX-INT8 (the same bits)", "splitinfer w8a8 on AVX-512 VNNI"),
}
STALE_LOCK_S = 600  # a build takes about a minute on 2 cores: a lock this old is a killed build's
LAYOUT = ("w4a8_group", "w4a8_cols", "w4a8_tile_bytes", "w8a8_cols", "w8a8_tiles", "w8a8_rows", "w8a8_depth")


@dataclass(frozen=True)
class KernelSet:
    """Which of splitinfer's kernels may run (each also needs the library loaded: `runs`)."""

    w8a8: bool = True  # int8 products (else FBGEMM's)
    w4a8: bool = True  # int4 products (else PyTorch's, on bfloat16 inputs)
    rows_attention: bool = True  # exact-rows attention (else PyTorch's SDPA, a row at a time)
    rms_norm: bool = True  # the norms of integer layers (else F.rms_norm)
    decoder_layer: bool = True  # whole integer layers as one call (else the layer's modules in Python)
    row_top: bool = True  # Token Recycling's top-k (else softmax + topk)
    amx: bool = True  # int8 products on AMX tiles where the CPU has them (else AVX-512 VNNI); process-wide

    @classmethod
    def parse(cls, text: str) -> "KernelSet":
        """'all' or 'none', then entries 'NAME' (on) or '-NAME' (off), comma-separated: 'all,-rms_norm'."""
        entries = [e.strip() for e in text.split(",") if e.strip()] or ["all"]
        chosen = dict.fromkeys(KERNELS, entries[0] == "all")  # a list of names alone: those, and no other
        for entry in entries[1:] if entries[0] in ("all", "none") else entries:
            name = entry.lstrip("-")
            if name not in KERNELS:
                raise ConfigError(f"{ENV}: {name!r} is not a kernel; name one of {', '.join(KERNELS)} "
                                  "(e.g. all,-rms_norm), or all, or none.")
            chosen[name] = not entry.startswith("-")
        return cls(**chosen)

    def spec(self) -> str:
        off = [f.name for f in fields(self) if not getattr(self, f.name)]
        return "all" if not off else "none" if len(off) == len(KERNELS) else ",".join(["all"] + [f"-{n}" for n in off])


class _State:
    """This process's library: loaded or not, why not, and the chosen set (one object, set by `ensure`)."""

    loaded = False
    reason = "not loaded yet: call splitinfer.kernels.ensure() (or run `splitinfer kernels`)"
    chosen: KernelSet | None = None  # None until `ensure` decides
    amx = False  # whether this CPU and Linux let the int8 product use AMX tiles (found when the library loads)


_STATE = _State()


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


def cache_dir() -> Path:
    """Where the built library is kept between starts: PyTorch's extension cache, a directory per installed copy
    of the sources (two venvs under one home, as on a workstation that also serves, would otherwise rebuild
    each other's library at every start: the build's commands name the sources' paths)."""
    from torch.utils.cpp_extension import _get_build_directory

    copy = hashlib.sha256(str(HERE.resolve()).encode()).hexdigest()[:8]
    return Path(_get_build_directory(f"{NAME}_{copy}", verbose=False))


def ensure(choice: KernelSet | None = None) -> bool:
    """Build the kernels if this machine has not yet, load them, and choose which run: `choice`, else the
    choice made before in this process, else SPLITINFER_KERNELS (default all). Returns whether the library is
    loaded. Logs what it did, once a process."""
    if choice is not None or _STATE.chosen is None:
        _STATE.chosen = choice if choice is not None else KernelSet.parse(os.environ.get(ENV, "all"))
    if _STATE.loaded:
        use_amx(_STATE.chosen.amx)
        return True
    if not any(getattr(_STATE.chosen, name) for name in KERNELS):
        _STATE.reason = f"turned off ({ENV}={_STATE.chosen.spec()})"
        return False
    if not cpu_supports():
        missing = sorted(set(CPU_FLAGS) - cpu_flags())
        _STATE.reason = f"this CPU lacks {', '.join(missing)}"
    else:
        try:
            _load()
        except Exception as exc:  # no compiler, no ninja, headers missing: the fallbacks serve instead
            _STATE.reason = f"the build failed ({type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]})"
    if not _STATE.loaded:
        log.warning("splitinfer's CPU kernels do not run here: %s; PyTorch's kernels run instead "
                    "(`splitinfer kernels` shows which)", _STATE.reason)
    return _STATE.loaded


def clear_stale_lock(directory: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove the build lock a killed build left behind (Ctrl-C, a timeout), which PyTorch's loader would wait on
    for ever; one younger than `max_age_s` may be another process building now and stays. Returns whether one went."""
    lock = directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < max_age_s:
        return False
    log.warning("removing %s, left %.0f s ago by a build that did not finish; building again", lock, age)
    lock.unlink(missing_ok=True)
    return True


def _load() -> None:
    from torch.utils import cpp_extension

    clear_stale_lock(cache_dir())
    start = time.perf_counter()
    log.info("loading splitinfer's CPU kernels from %s (built there first where the sources changed: about a "
             "minute on 2 cores, once per install)", cache_dir())
    header = hashlib.sha256(HEADER.read_bytes()).hexdigest()[:16]  # a header change rebuilds
    cpp_extension.load(name=NAME, sources=[str(s) for s in SOURCES], build_directory=str(cache_dir()),
                       extra_cflags=[*CFLAGS, f"-DSPLITINFER_HEADER={header}"], extra_ldflags=LDFLAGS,
                       is_python_module=False, verbose=False)
    _register_fakes()
    _STATE.loaded, _STATE.reason = True, "loaded"
    use_amx(_STATE.chosen.amx)
    seconds = time.perf_counter() - start
    if seconds > 5:  # a load takes a fraction of a second: this was a build
        log.warning("built splitinfer's CPU kernels into %s in %.0f s; later starts load them", cache_dir(), seconds)


@contextlib.contextmanager
def choosing(choice: KernelSet):
    """Construct modules with `choice` as the process's kernel set while inside, then restore the one before
    (tests of the fallbacks; bench A/B runs that load one shard twice)."""
    ensure()
    before = _STATE.chosen
    _STATE.chosen = choice
    use_amx(choice.amx)
    try:
        yield
    finally:
        _STATE.chosen = before
        use_amx(before.amx)


def available() -> bool:
    """Whether the kernel library is loaded in this process (never builds: `ensure` does)."""
    return _STATE.loaded


def runs(name: str) -> bool:
    """Whether kernel `name` runs here: loaded, and chosen. Modules ask once, when they are constructed; AMX
    is the product's choice at each call (`use_amx`), and runs only where w8a8 does and the CPU has it."""
    assert name in KERNELS, name
    if name == "amx":
        return runs("w8a8") and _STATE.chosen.amx and _STATE.amx
    return _STATE.loaded and getattr(_STATE.chosen or KernelSet(), name)


def use_amx(on: bool) -> bool:
    """Turn the int8 product's AMX path on or off for the whole process (w8a8.cpp reads it at each call; the
    bits are the same either way). Returns whether it runs: the library is loaded and the CPU and Linux allow it."""
    if not _STATE.loaded:
        return False
    _STATE.amx = torch.ops.splitinfer.amx(on)
    return on and _STATE.amx


def report() -> dict[str, str]:
    """{kernel: what runs for it here}, as `serve`, `bench step` and `splitinfer kernels` print it."""
    return {name: f"splitinfer {name}" if runs(name) else fallback for name, (_, fallback) in KERNELS.items()}


def status() -> dict:
    """What `splitinfer kernels` prints: the CPU, the cache, whether loaded and why not, and the table."""
    return {"cpu_supports": cpu_supports(), "missing_cpu_flags": sorted(set(CPU_FLAGS) - cpu_flags()),
            "cache": str(cache_dir()), "loaded": _STATE.loaded, "reason": _STATE.reason,
            "chosen": (_STATE.chosen or KernelSet()).spec(), "kernels": report()}


def layout() -> dict[str, int]:
    """The packing layout the loaded library was compiled with (layout.h), by LAYOUT's names."""
    assert _STATE.loaded, "the kernel library is not loaded"
    return dict(zip(LAYOUT, torch.ops.splitinfer.layout()))


def _register_fakes() -> None:
    """Shapes of the ops for torch.compile's tracing (a compiled pass runs around them)."""

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
