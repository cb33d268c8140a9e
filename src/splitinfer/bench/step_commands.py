"""`splitinfer bench` commands that time the compute of a step on this machine: `step` and `formats` (whole steps),
`kernels` (one weight product alone), `kernel-ab` (each kernel on and off, in whole steps), `arena` (weights in
huge pages or not), `compile` (eager against torch.compile), `memory` (the resident set a loaded half adds),
`step-ab` (this tree's step against another's) and `trusted-half` (the paper's 7B trusted half, synthetic weights).

Parsing only: each command's measurement lives in its own module (step.py, formats.py, products.py, kernel_ab.py,
arena_step.py, compiled.py, memory.py, step_ab.py, trusted.py), imported when the command runs, and writes its
record through bench/harness.py. Nothing heavy is imported here.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..options import Opt, Shared, add_options, defer, described
from ..wire.dtypes import DTYPE_NAMES
from .parsers import add_shards_and_out, floats, listed, reporting


@dataclass(frozen=True)
class KernelsBenchOptions:
    """The defaults of `splitinfer bench kernels`."""

    rows: str = ""  # comma-separated input rows (default: the product's own)
    repeats: int = 0  # timed calls (w8a8-stream: rounds) after the warm-up (0: the product's own, 50, 200 or 15)


@dataclass(frozen=True)
class KernelABOptions:
    """The defaults of `splitinfer bench kernel-ab`."""

    kernels: str = ""  # comma-separated kernels to compare on and off (default every one); none against all always
    rows: str = "1,4,8"  # comma-separated block rows
    context: int = 64  # cached rows each step attends to
    repeats: int = 60  # timed rounds, every kernel set, side and block size once a round
    warmup: int = 3  # untimed rounds first
    threads: int = 1  # torch threads
    cpu: int = 0  # core to pin to (-1: none)


@dataclass(frozen=True)
class ArenaBenchOptions:
    """The defaults of `splitinfer bench arena`."""

    rows: str = "1,2,4,5,6,8"  # comma-separated block rows
    rounds: int = 100  # timed rounds, each copy once a round, after one untimed round


@dataclass(frozen=True)
class CompileBenchOptions:
    """The defaults of `splitinfer bench compile`."""

    rows: str = "1,2,4,8,16"  # comma-separated block rows
    contexts: str = "64,2048"  # comma-separated cached rows before the block
    repeats: int = 5  # timed rounds after one untimed round
    cpu: int = 0  # core to pin to (-1: none)
    steps: int = 1  # 0: skip the per-step comparison
    decode_rows: int = 4  # rows of the growing-context blocks
    decode_blocks: int = 40  # growing-context blocks (0: none)
    generations: int = 0  # also whole generations, eager against a compiled cloud: prompts per category (0: none)
    tokens: int = 128  # new tokens a generation
    compile_rows: int = 4  # the compiled cloud's least block rows


@dataclass(frozen=True)
class StepABOptions:
    """The defaults of `splitinfer bench step-ab`."""

    shards: str = "shards/formats/int8"  # a prepared OUT directory (an int8 one runs the most kernels)
    rows: str = "1,2,4,5,6,7,8,16"  # comma-separated block rows
    contexts: str = "64"  # comma-separated cached rows before the block
    repeats: int = 7  # bench step's timed repetitions a run
    rounds: int = 4  # runs from each tree, alternating


@dataclass(frozen=True)
class TrustedHalfOptions:
    """The defaults of `splitinfer bench trusted-half`."""

    config: str = "mistral-7b-v0.1"  # a name `bench plan` knows, or a config.json
    shards: str = ""  # where the synthetic local shard is made once (default: shards/synthetic-CONFIG)
    formats: str = "float32,bfloat16,int8,int4"  # comma-separated weight formats ('': the cloud layers only)
    threads: str = "1,2"  # comma-separated torch thread counts (one thread pinned to core 0, more unpinned)
    rows: str = "1,4,8,16,32,64"  # comma-separated block rows
    contexts: str = "64,2048"  # comma-separated cached rows before the block
    repeats: int = 3  # bench step's timed repetitions a run
    cloud_layers: int = 0  # also time this many of the cloud's layers in bfloat16, scaled to all of them (0: none)


def cmd_bench_step(args) -> int:
    from .step import StepBenchConfig, run_step_bench

    config = StepBenchConfig(
        rows=tuple(int(x) for x in floats(args.rows, "--rows")),
        contexts=tuple(int(x) for x in floats(args.contexts, "--contexts")),
        sides=_sides(args.sides),
        **{f: getattr(args, f) for f in ("threads", "cpu", "dtype", "repeats", "max_ratio", "guard_rows", "e2e_prompts",
                                         "e2e_tokens", "e2e_max_ratio")},
    )
    report = run_step_bench(Path(args.shards), Path(args.out), config, log=lambda line: print(line, file=sys.stderr))
    if not report["guard"]["passed"]:
        print("bench step guard failed: " + "; ".join(report["guard"]["failures"]), file=sys.stderr)
        return 1
    return 0


def cmd_bench_formats(args) -> int:
    from .formats import FormatsBenchConfig, run_formats_bench

    config = FormatsBenchConfig(
        formats=tuple(f for f in args.formats.split(";") if f),
        rows=tuple(int(x) for x in floats(args.rows, "--rows")),
        contexts=tuple(int(x) for x in floats(args.contexts, "--contexts")),
        **{f: getattr(args, f) for f in ("prompts", "tokens", "repeats", "cpu", "threads", "shards_dir")},
    )
    if "float32" not in config.formats:
        raise ConfigError("bench formats compares against float32: include it in --formats.")
    report = run_formats_bench(args.model, Path(args.out), Path(config.shards_dir), config,
                               log=lambda line: print(line, file=sys.stderr))
    print((Path(args.out) / "formats.md").read_text())
    return 0 if report else 1


def _formats_options(s) -> None:
    from .formats import FormatsBenchConfig

    d = FormatsBenchConfig()
    s.add_argument("--model", help="HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    s.add_argument("--out", required=True, help="directory for formats.json and formats.md")
    s.add_argument("--formats", default=";".join(d.formats),
                   help="semicolon-separated `prepare --weights` specs (float32 is the reference and must be one)")
    s.add_argument("--rows", default=listed(d.rows), help="comma-separated block row counts")
    s.add_argument("--contexts", default=listed(d.contexts), help="comma-separated cached rows before the block")
    add_options(s, FormatsBenchConfig, (
        Opt("prompts", help="benchmark prompts to generate from"), Opt("tokens", help="new tokens a generation"),
        Opt("repeats", help="timed rounds after a warm-up round"), Opt("cpu", help="core to pin to (-1: none)"),
        Opt("threads", help="torch threads"),
        Opt("shards_dir", help="where each format's shards are prepared (one directory per format; `bench spec "
                               "--shards` takes them)"),
    ))


def _sides(text: str) -> tuple[str, ...]:
    sides = tuple(x.strip() for x in text.split(",") if x.strip())
    if not sides or any(x not in ("cloud", "local") for x in sides):
        raise ConfigError(f"--sides takes cloud, local or cloud,local; got {text!r}.")
    return sides


def _step_options(s) -> None:
    from .step import StepBenchConfig

    d = StepBenchConfig()
    add_shards_and_out(s, "step.json, step.md and step.png")
    s.add_argument("--rows", default=listed(d.rows), help="comma-separated block row counts")
    s.add_argument("--contexts", default=listed(d.contexts), help="comma-separated cached rows before the block")
    s.add_argument("--dtype", choices=DTYPE_NAMES, default=d.dtype, help="compute dtype (default: the shards')")
    s.add_argument("--sides", default=",".join(d.sides), help="the sides timed (cloud, local or both); only their "
                   "shards are loaded")
    add_options(s, StepBenchConfig, (
        Opt("threads", help="torch threads"), Opt("cpu", help="core to pin to (-1: none)"),
        Opt("repeats", help="timed repetitions after a warm-up round"),
        Opt("max_ratio", help="guard: exit 1 when a step of <= --guard-rows rows costs more than this times "
            "transformers' (0: off)"),
        Opt("guard_rows", help="largest block the guard checks"),
        Opt("e2e_prompts", help="also time whole generations (local-only vs transformers greedy) on this many prompts"),
        Opt("e2e_tokens", help="tokens per generation"),
        Opt("e2e_max_ratio", help="guard on the generations' ms per token (0: off)"),
    ))


def measured(module: str) -> Callable[[argparse.Namespace], int]:
    """A command running `module`'s `run(args, log)` (imported when the command runs), progress on stderr."""

    def command(args: argparse.Namespace) -> int:
        return reporting(importlib.import_module(f"splitinfer.bench.{module}").run)(args)

    return command


def _kernels_options(s) -> None:
    from .products import PRODUCTS

    s.add_argument("--kernel", required=True, choices=tuple(PRODUCTS),
                   help="w8a8: the int8 kernel against FBGEMM's and float32, weight in cache; w4a8: the int4 kernel "
                        "against PyTorch's; w8a8-stream: the int8 kernel streaming weights from memory, hardware "
                        "prefetchers against prefetcht0 16 KB ahead")
    add_options(s, Shared, (Opt("out", help="directory for KERNEL.json and KERNEL.md (w8a8-stream: w8a8_stream)"),))
    add_options(s, KernelsBenchOptions, described(KernelsBenchOptions, "rows", "repeats"))


def register(sub) -> None:
    s = sub.add_parser("step", help="one decode step's compute by block rows, against plain transformers "
                       "and the memory-bandwidth bound; a release guard on the ratio")
    defer(s, _step_options)
    s.set_defaults(func=cmd_bench_step)

    s = sub.add_parser("formats", help="every weight format side by side: steps against the bytes bound, local-only "
                       "tok/s against transformers float32, perplexity and agreement with float32")
    defer(s, _formats_options)
    s.set_defaults(func=cmd_bench_formats)

    s = sub.add_parser("kernels", help="one weight product alone: splitinfer's int8 or int4 kernel against the one it "
                       "replaced, or streaming from memory")
    defer(s, _kernels_options)
    s.set_defaults(func=measured("products"))

    s = sub.add_parser("kernel-ab", help="each of splitinfer's CPU kernels against the library path it replaces, in "
                       "whole steps: each kernel on and off, all against none")
    add_shards_and_out(s, "kernel_ab.json and kernel_ab.md")
    add_options(s, KernelABOptions, described(KernelABOptions, *KernelABOptions.__dataclass_fields__))
    s.set_defaults(func=measured("kernel_ab"))

    s = sub.add_parser("arena", help="a step with the integer weights in one huge-page arena against their own "
                       "allocations, alternating in one process")
    add_shards_and_out(s, "arena.json and arena.md")
    add_options(s, ArenaBenchOptions, described(ArenaBenchOptions, "rows", "rounds"))
    s.set_defaults(func=measured("arena_step"))

    s = sub.add_parser("compile", help="eager against torch.compile: steps by rows and context, growing contexts, "
                       "whole generations")
    add_shards_and_out(s, "compile.json and compile.md")
    add_options(s, CompileBenchOptions, described(CompileBenchOptions, *CompileBenchOptions.__dataclass_fields__))
    s.set_defaults(func=measured("compiled"))

    s = sub.add_parser("memory", help="the resident memory each loaded half adds, against its weights file")
    add_options(s, Shared, (Opt("shards", help="comma-separated prepared OUT directories"),
                            Opt("out", help="directory for memory.json and memory.md")))
    s.set_defaults(func=measured("memory"))

    s = sub.add_parser("step-ab", help="this tree's decode step against another tree's: bench step from each, "
                       "alternating round by round")
    s.add_argument("--other-src", required=True, help="the other tree's src directory")
    add_options(s, Shared, (Opt("out", help="directory for step_ab.json, step_ab.md and each round's runs"),))
    add_options(s, StepABOptions, described(StepABOptions, *StepABOptions.__dataclass_fields__))
    s.set_defaults(func=measured("step_ab"))

    s = sub.add_parser("trusted-half", help="the paper's 7B trusted half on this CPU: bench step on synthetic "
                       "shards per weight format and thread count, against the bytes bound")
    add_options(s, Shared, (Opt("out", help="directory for the runs and trusted-half.json, .md and .png"),))
    add_options(s, TrustedHalfOptions, described(TrustedHalfOptions, *TrustedHalfOptions.__dataclass_fields__))
    s.add_argument("--report-only", action="store_true", help="rebuild the combined table from the stored runs")
    s.add_argument("--docs", help="also put the table and plot between the trusted-half markers of this file")
    s.set_defaults(func=measured("trusted"))
