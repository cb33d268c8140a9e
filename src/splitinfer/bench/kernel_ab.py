"""Each of splitinfer's CPU kernels against the maintained-library path it replaces, in whole steps.

`splitinfer bench kernel-ab` compares, for each kernel, a step with it and the same step with it turned off
(SPLITINFER_KERNELS's sets), everything else equal. The whole-layer call (decoder_layer) runs only on
splitinfer's products and norms and does its own attention, so the kernels it subsumes (the products, the
norms, the attention rows) are compared with it off, where they are what runs (a layer outside its reach: a
family without the fused forwards, a head dimension it does not take); decoder_layer and Token Recycling's
top-k are compared against every kernel on, and so is AMX (the int8 product's path where the CPU has AMX-INT8,
chosen process-wide at each call: each set turns it on or off before its step). `none` against all is the path
a CPU without the kernels takes.

Each set's layers are built as loading builds them (model/layers.py chooses each module's kernel at
construction, under kernels.choosing). One comparison at a time, only its two sets loaded (each keeps the
caches a lone process would: SmolLM2's halves fit this machine's L3 twice, not seven times), one step of each
side is timed round by round, both sets, sides and block sizes once a round in a shuffled order
(bench/harness.py, as `bench step` times), so the machine's drift falls on both alike:

    cloud  the middle layers (the cloud's step)
    local  the head and tail layers, the final norm, the LM head, and Token Recycling's observation of the
           logits (decoding/sources.py: what the tree strategy does with every step's logits; its top-k kernel,
           row_top, is compared on this side alone)

For each comparison it reports both medians and the median over rounds of (off) / (on): above 1, the kernel
gains that much. A comparison whose two sets build the same modules (the shard never runs that kernel) is
named and not timed. Outputs are compared bit for bit: the products and the whole-layer call give the
library path's bits; int4's product and the norms' kernel round differently.
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import torch

from .. import kernels
from ..decoding.sources import TokenRecycling
from ..decoding.tree import TreeConfig
from ..errors import ConfigError
from ..launch import pin_self
from ..model.layers import kernel_table
from ..tables import table
from .harness import command_line, median_ms, paired_ratio, rounds, write
from .side import Side, build_sides
from .step import shard_manifest

ALL = "all"


class Variant:
    """One kernel set's sides, built under it, and the Token Recycling observer its client would build."""

    def __init__(self, spec: str, shards: Path, context: int, rows: tuple[int, ...]):
        chosen = kernels.KernelSet.parse(spec)
        self.spec, self.amx = spec, chosen.amx
        with kernels.choosing(chosen):
            present = tuple(side for side in ("cloud", "local") if (shards / side).is_dir())  # a synthetic 7B: local only
            self.sides = {s.name: s for s in build_sides(shards, (context,), rows, sides=present)}
            self.recycling = TokenRecycling(TreeConfig().recycling_k)
        stacks = [stack for side in self.sides.values() for stack in side.stacks]
        tails = [m for side in self.sides.values() for m in side.tail or ()]
        self.modules = kernel_table(*stacks, *tails)
        self.modules["row_top (Token Recycling)"] = int(self.recycling._row_top)

    @torch.inference_mode()
    def step(self, side: str, q: int) -> torch.Tensor:
        s: Side = self.sides[side]
        kernels.build.use_amx(self.amx)  # process-wide, read by each product: this set's choice for its step
        out = s.ours(q, s.block(q))
        if side == "local":
            self.recycling.observe(list(range(q)), out[0])
        return out


# {kernel: (the set it is compared in, that set without it)}; none against all last.
WITHOUT_LAYER = "all,-decoder_layer"
COMPARISONS = {
    "w8a8": (WITHOUT_LAYER, WITHOUT_LAYER + ",-w8a8"),
    "w4a8": (WITHOUT_LAYER, WITHOUT_LAYER + ",-w4a8"),
    "rows_attention": (WITHOUT_LAYER, WITHOUT_LAYER + ",-rows_attention"),
    "rms_norm": (WITHOUT_LAYER, WITHOUT_LAYER + ",-rms_norm"),
    "decoder_layer": (ALL, WITHOUT_LAYER),
    "row_top": (ALL, "all,-row_top"),
    "amx": (ALL, "all,-amx"),
}


ONLY = {"row_top": ("local",)}  # the sides a kernel runs on, where not every side: the cloud never drafts


def comparisons(names: list[str] | None) -> dict[str, tuple[str, str]]:
    """{kernel: (on, off)} for each kernel named (default every kernel), then none: (all, none)."""
    names = list(kernels.KERNELS) if names is None else names
    unknown = [n for n in names if n not in kernels.KERNELS]
    if unknown:
        raise ConfigError(f"--kernels: {', '.join(unknown)} not a kernel; name some of {', '.join(kernels.KERNELS)}.")
    return {**{n: COMPARISONS[n] for n in names}, "none": (ALL, "none")}


def measure(shards: Path, rows: tuple[int, ...], context: int, repeats: int, warmup: int,
            names: list[str] | None = None, log=print) -> dict:
    """The comparisons of `names` (default every kernel) on `shards`, one at a time: the stored record."""
    results, modules, skipped = [], {}, []
    for kernel, (on, off) in comparisons(names).items():
        pair = {spec: Variant(spec, shards, context, rows) for spec in (on, off)}
        # AMX builds no module of its own (the int8 product chooses at each call): not run where the CPU lacks it
        if (not kernels.runs("amx")) if kernel == "amx" else pair[on].modules == pair[off].modules:
            skipped.append(kernel)  # this shard never runs the kernel
            continue
        log(f"{kernel}: {on} against {off}")
        modules.update({spec: v.modules for spec, v in pair.items()})
        results += compare(kernel, pair[on], pair[off], rows, repeats, warmup)
    return {"shards": str(shards), "weights": shard_manifest(shards).get("weights"),
            "config": {"rows": list(rows), "context": context, "repeats": repeats, "warmup": warmup},
            "kernels": kernels.status(), "modules": modules, "not_run": skipped, "rows": results,
            "gains": gains(results)}


def compare(kernel: str, on: Variant, off: Variant, rows: tuple[int, ...], repeats: int, warmup: int) -> list[dict]:
    """One kernel's rows: both sets' steps in alternating rounds (only these two sets loaded, so each keeps the
    caches a lone process would), and whether their outputs had the same bits in every round."""
    sides = ONLY.get(kernel, tuple(on.sides))
    keys = [(v, side, q) for v in (on, off) for side in sides for q in rows]
    calls = {(v.spec, side, q): (lambda v=v, side=side, q=q: v.step(side, q)) for v, side, q in keys}
    identical: dict[tuple, bool] = {}

    def check(outputs: dict) -> None:
        for side in sides:
            for q in rows:
                same = torch.equal(outputs[(on.spec, side, q)], outputs[(off.spec, side, q)])
                identical[(side, q)] = identical.get((side, q), True) and same

    times = rounds(calls, repeats, warmup=warmup, shuffle=random.Random(0), check=check)
    return [{"kernel": kernel, "on": on.spec, "off": off.spec, "side": side, "rows": q,
             "on_ms": median_ms(times[(on.spec, side, q)]), "off_ms": median_ms(times[(off.spec, side, q)]),
             "x_off": paired_ratio(times[(off.spec, side, q)], times[(on.spec, side, q)]),
             "identical": identical[(side, q)]} for side in sides for q in rows]


def gains(rows: list[dict]) -> dict[str, float]:
    """{kernel: the median over sides and block sizes of off / on}: one figure per kernel."""
    by_kernel: dict[str, list[float]] = {}
    for r in rows:
        by_kernel.setdefault(r["kernel"], []).append(r["x_off"])
    return {k: round(statistics.median(v), 3) for k, v in by_kernel.items()}


def body(report: dict) -> list[str]:
    header = ["kernel", "on", "off", "side", "rows", "on ms", "off ms", "off / on (median round)", "same bits"]
    cells = [[r["kernel"], r["on"], r["off"], r["side"], r["rows"], r["on_ms"], r["off_ms"], r["x_off"],
              "yes" if r["identical"] else "no"] for r in report["rows"]]
    gain = ", ".join(f"{k} x{x}" for k, x in report["gains"].items())
    c = report["config"]
    return [f"Shards `{report['shards']}` (weights {report['weights']}); {c['context']} cached rows; "
            f"{c['repeats']} rounds after {c['warmup']} untimed; medians. Not run by this shard (the same modules "
            f"either way): {', '.join(report['not_run']) or 'none'}.", "",
            f"Off / on, the median over sides and block sizes: {gain}.", "", *table(header, cells)]


def run(args, log=print) -> dict:
    """`splitinfer bench kernel-ab`: pinned as asked, then OUT/kernel_ab.json and .md."""
    if not kernels.ensure():
        raise ConfigError(f"splitinfer's kernels do not run here ({kernels.status()['reason']}): nothing to compare.")
    pin_self(args.cpu if args.cpu >= 0 else None, args.threads)
    names = [n.strip() for n in args.kernels.split(",") if n.strip()] or None
    report = measure(Path(args.shards), tuple(int(r) for r in args.rows.split(",")), args.context, args.repeats,
                     args.warmup, names, log)
    write(Path(args.out), "kernel_ab", report, body(report), title="Each kernel against the library path, whole steps",
          command=command_line(args), log=log)
    return report
