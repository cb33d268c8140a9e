"""CLI of the `splitinfer bench` group: sweep, spec, probe and plan (step_commands.py and system_commands.py
register the developer benchmarks; batch, acceptance, load and the rest register from their own modules).

    splitinfer bench sweep --shards shards/smollm2 --out notes/bench     # the full sweep (~22 min quiet)
    splitinfer bench sweep --quick --out /tmp/bench                     # a smaller sweep (minutes)
    splitinfer bench sweep --report-only --out notes/bench               # Markdown + plots from bench.json
    splitinfer bench probe --server ws://HOST:PORT [--bench notes/bench/bench.json] [--expect-rtt-ms 80]
    splitinfer bench plan  --config mistral-7b-v0.1 [--head-layers 2] [--tail-layers 2] [--dtype float16] [--json]
    splitinfer bench spec  --shards shards/smollm2 --out notes/bench     # speculative strategies vs sequential

Parsing and orchestration only; nothing heavy is imported until a command runs (the `bench sweep` options, whose
help quotes SweepConfig's defaults, are added when that command is used).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..errors import ConfigError
from ..model.commands import SplitOptions
from ..options import MIB, Opt, Shared, add_options, config_from_args, defer
from ..wire.dtypes import DTYPE_NAMES
from .parsers import add_shards_and_out, floats, listed
from .plan import DEFAULT_MESSAGE_BYTES, Rates

RATE_OPTIONS = (
    Opt("rtt_ms"),
    Opt("cloud_tflops", help="assumed effective cloud compute rate"),
    Opt("cloud_gbps", help="assumed cloud memory bandwidth, GB/s"),
    Opt("local_tflops"),
    Opt("local_gbps"),
)


@dataclass(frozen=True)
class BenchOptions:
    """The defaults of `splitinfer bench` beyond SweepConfig's: the projection and the prefill measurement."""

    project_rtt_ms: str = "1,5,10,200,300,500"  # RTTs for the projection table
    prefill_tokens: str = "1024,8192,32768"  # prompt lengths for the prefill measurement
    prefill_mbit: float = 100.0  # bandwidth limit per direction for prefill
    prefill_rtt_ms: float = 40.0  # added round trip for prefill
    prefill_real_max: int = 1024  # largest prompt also prefilled for real


@dataclass(frozen=True)
class ProbeOptions:
    """The defaults of `splitinfer bench probe`."""

    small: int = 50  # small messages for the round trip
    large: int = 3  # large messages each way for the bandwidth
    large_kb: int = 1024  # size of a large message, KiB


@dataclass(frozen=True)
class SpecBenchOptions:
    """The defaults of `splitinfer bench spec`."""

    strategies: str = "sequential,lookahead,tree"  # comma-separated strategy names; sequential always runs
    rtt_ms: str = "0,80"  # comma-separated added round trips
    max_new_tokens: int = 128  # tokens per generation
    repeats: int = 2  # measured repetitions
    per_category: int = 3  # prompts taken from each category
    in_flight: str = "1"  # comma-separated blocks in flight (1-3, or auto)
    cloud_pass_ms: float = 0.0  # the fast-cloud scenario's least pass time (serve --min-pass-ms); 0: off
    cloud_compile_rows: int = 0  # the cloud compiles blocks of this many rows and more (serve --compile-rows); 0: off
    turns: int = 1  # 2: prompts with a second turn (MT-Bench) also run it in the same conversation
    pad_rows: str = "0"  # comma-separated padding settings (wire/padding.py's PadSetting; 0: none) to run each strategy with
    pad_prompt_rows: int = 0  # padded configurations also pad prompts to this many rows (ClientConfig.pad_prompt_rows)


@dataclass(frozen=True)
class PlanOptions:
    """The defaults of `splitinfer bench plan` beyond the split (SplitOptions)."""

    dtype: str = "float16"  # weights and KV: a model sized for serving, unlike the float32 shards `prepare` makes


def _sweep_config(args):
    from .runtime import MODES, QUICK, SweepConfig

    config = QUICK if args.quick else SweepConfig()
    if args.rtt_ms:
        config = replace(config, rtts_ms=floats(args.rtt_ms, "--rtt-ms"))
    if args.modes:
        modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
        unknown = [m for m in modes if m not in MODES]
        if unknown:
            raise ConfigError(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}.")
        config = replace(config, modes=modes)
    for field in ("max_new_tokens", "per_category", "repeats"):
        value = getattr(args, field)
        if value is not None:
            if value < 1:
                raise ConfigError(f"--{field.replace('_', '-')} must be at least 1.")
            config = replace(config, **{field: value})
    return config


def cmd_bench(args) -> int:
    from ..extras import BENCH, require_extra

    require_extra("bench", BENCH, "splitinfer bench sweep")
    from . import report as reporting

    out = Path(args.out)
    if args.report_only:
        try:
            data = json.loads((out / "bench.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read {out / 'bench.json'} ({exc}); run `splitinfer bench sweep --out {out}` first.") from exc
        from .summary import summarize

        # recomputed from the raw runs, so a newer summary applies to an older sweep
        old = data["summary"]
        price = args.gpu_price if args.gpu_price is not None else old["gpu_price_per_hour"]
        projection = old.get("projection_rtts") or [p["rtt_ms"] for p in old["projection"]]
        data["summary"] = summarize({"runs": data["runs"], "probe_rtt_ms": data["probe_rtt_ms"]}, price, projection)
        _write_report(data, out, args.docs)
        return 0
    import torch

    from .. import __version__
    from ..launch import cloud_server
    from .prefill import run_prefill
    from .parsers import log_stderr
    from .runtime import load_prompts, run_sweep
    from .summary import summarize

    shards = Path(args.shards)
    if not (shards / "local" / "manifest.json").exists():
        raise ConfigError(f"{shards} holds no prepared shards; run `splitinfer prepare --out {shards}` (or `make prepare`).")
    config = _sweep_config(args)
    prompts = load_prompts(args.prompts, config.per_category)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    raw = run_sweep(shards, prompts, config, log=log_stderr)
    prefill = None
    if not args.no_prefill:
        sizes = tuple(int(x) for x in floats(args.prefill_tokens, "--prefill-tokens"))
        with cloud_server(shards / "cloud", cpu=1, threads=1) as (url, _):
            prefill = run_prefill(shards, url, sizes, args.prefill_rtt_ms, args.prefill_mbit, args.prefill_real_max,
                                  log=log_stderr)
    data = {
        "command": "splitinfer bench sweep " + " ".join(shlex.quote(a) for a in sys.argv[3:]),
        "splitinfer": __version__,
        "torch": torch.__version__,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "processor": platform.processor()},
        "setup": "client and local-only models: this process, core 0, 1 thread; cloud server: child process, core 1, "
        "1 thread; WAN emulators: child processes on core 1; float16 wire; greedy",
        "model": json.loads((shards / "local" / "manifest.json").read_text())["model_id"],
        "config": asdict(config),
        "prompts": [p["id"] for p in prompts],
        "elapsed_s": round(time.monotonic() - started, 1),
        "summary": summarize(raw, 2.0 if args.gpu_price is None else args.gpu_price,
                             list(floats(args.project_rtt_ms, "--project-rtt-ms"))),
        "prefill": prefill,
        "probe_rtt_ms": raw["probe_rtt_ms"],
        "runs": raw["runs"],
    }
    _write_report(data, out, args.docs)
    print(reporting.markdown(data))
    return 1 if any(not c["passed"] for c in data["summary"]["checks"]) else 0


def _write_report(data: dict, out: Path, docs: str | None) -> None:
    from . import report as reporting

    data["plots"] = reporting.plot(data, out)  # cmd_bench checked for the bench extra
    data.pop("plots_error", None)
    (out / "bench.json").write_text(json.dumps(data, indent=1))
    (out / "bench.md").write_text(reporting.markdown(data))
    if docs:
        reporting.update_docs(Path(docs), data, out)
    for c in data["summary"]["checks"]:
        print(f"{'PASS' if c['passed'] else 'FAIL'}: {c['check']}: {c['measured']} vs {c['expected']} "
              f"({c['relative_error']:.1%}, tolerance {c['tolerance']:.0%})", file=sys.stderr)
    print(f"wrote {out / 'bench.json'}, {out / 'bench.md'} and {len(data['plots'])} plot(s)", file=sys.stderr)


def cmd_probe(args) -> int:
    from .probe import run

    return run(args)


def cmd_plan(args) -> int:
    from .plan import load_config, plan, text_report

    label, cfg = load_config(args.config)
    rates = config_from_args(Rates, args, RATE_OPTIONS)
    result = plan(cfg, args.head_layers, args.tail_layers, args.dtype, args.wire_dtype,
                  args.max_message_mb * MIB, rates)
    print(json.dumps({"config": label, **result}) if args.json else text_report(label, result))
    return 0


def cmd_bench_spec(args) -> int:
    from .speculative import run_interleaved, run_speculative_bench

    if "," in str(args.shards):
        from .spec_formats import run_spec_formats

        run_spec_formats(args, run_interleaved)
    else:
        run_speculative_bench(args)
    return 0


def _bench_options(s) -> None:
    from .runtime import MODES, QUICK, SweepConfig

    full = SweepConfig()
    add_shards_and_out(s, "bench.json, bench.md and the plots")
    s.add_argument("--quick", action="store_true", help=f"RTT {listed(QUICK.rtts_ms)}, {QUICK.max_new_tokens} tokens, "
                   f"{QUICK.repeats} repetition(s) (a few minutes)")
    s.add_argument("--report-only", action="store_true", help="rebuild bench.md and the plots from OUT/bench.json")
    s.add_argument("--docs", help="also write the report into this Markdown file between its two bench markers "
                   "(notes/benchmarks.md)")
    s.add_argument("--prompts", help="JSONL prompt file, or mt-bench for MT-Bench's first turns (`make chat-data`; default: "
                   "the packaged benchmark prompts)")
    s.add_argument("--rtt-ms", help=f"comma-separated added round trips (default {listed(full.rtts_ms)})")
    s.add_argument("--modes", help=f"comma-separated: {','.join(MODES)}")
    s.add_argument("--max-new-tokens", type=int,
                   help=f"tokens per generation (default {full.max_new_tokens}; --quick {QUICK.max_new_tokens})")
    s.add_argument("--per-category", type=int, help=f"prompts taken from each category (default {full.per_category})")
    s.add_argument("--repeats", type=int,
                   help=f"measured repetitions after the warm-up (default {full.repeats}; --quick {QUICK.repeats})")
    s.add_argument("--gpu-price", type=float, help="assumed $ per GPU-hour for the cost table (default 2.0)")
    add_options(s, BenchOptions, (Opt("project_rtt_ms", help="RTTs for the projection table"),))
    s.add_argument("--no-prefill", action="store_true", help="skip the prefill measurement")
    add_options(s, BenchOptions, (
        Opt("prefill_tokens", help="prompt lengths for the prefill measurement"),
        Opt("prefill_mbit", help="bandwidth limit per direction for prefill"),
        Opt("prefill_rtt_ms", help="added round trip for prefill"),
        Opt("prefill_real_max", help="largest prompt also prefilled for real"),
    ))


def register(sub) -> None:
    from ..local.auth import add_client_auth_args

    s = sub.add_parser("sweep", help="sweep: added RTT x decoding mode x prompt category; fits, cost, prefill, plots")
    defer(s, _bench_options)
    s.set_defaults(func=cmd_bench)

    s = sub.add_parser("probe", help="measure round trip and bandwidth to a server; expected tok/s per mode")
    s.add_argument("--server", required=True, help="ws:// or wss:// URL of `splitinfer serve`")
    add_options(s, ProbeOptions, (
        Opt("small", help="small messages for the round trip"),
        Opt("large", help="large messages each way for the bandwidth"),
        Opt("large_kb", help="size of a large message, KiB"),
    ))
    s.add_argument("--bench", help="bench.json with the fitted model (default: notes/bench/bench.json if present)")
    s.add_argument("--expect-rtt-ms", type=float, help="check the median round trip is within 10%% of this")
    s.add_argument("--json", action="store_true")
    add_client_auth_args(s)
    s.set_defaults(func=cmd_probe)

    s = sub.add_parser("plan", help="size a split from a model config: memory, KV, wire bytes, RTT/compute")
    s.add_argument("--config", required=True, help="config.json path, or mistral-7b-v0.1, mistral-nemo-12b, "
                   "llama-3.1-8b, llama-3.1-70b, llama-3.1-405b")
    add_options(s, SplitOptions, (Opt("head_layers"), Opt("tail_layers")))
    add_options(s, PlanOptions, (Opt("dtype", choices=DTYPE_NAMES, help="weights and KV"),))
    s.add_argument("--wire-dtype", choices=DTYPE_NAMES, help="default: --dtype")
    s.add_argument("--max-message-mb", type=int, default=DEFAULT_MESSAGE_BYTES // MIB,
                   help="the server's message limit, MiB")
    add_options(s, Rates, RATE_OPTIONS)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_plan)

    s = sub.add_parser("spec", help="speculative strategies vs sequential: accepted tokens per step, tok/s")
    add_options(s, Shared, (
        Opt("shards", help="a prepared OUT directory, or several separated by commas (weight formats, `prepare "
                           "--weights`): each prompt runs on every one before the next, and OUT/formats.md "
                           "compares them against the first"),
        Opt("out", help="directory for speculative.json and speculative.md"),
    ))
    s.add_argument("--prompts", help="JSONL prompt file, or mt-bench for MT-Bench's first turns (`make chat-data`; default: "
                   "the packaged benchmark prompts)")
    add_options(s, SpecBenchOptions, (
        Opt("strategies", help="comma-separated strategy names: any registered one (a learned head's joins by its "
                               "name); sequential is always run"),
        Opt("rtt_ms", help="comma-separated added round trips"),
        Opt("max_new_tokens"),
        Opt("repeats"),
        Opt("per_category", help="prompts taken from each category"),
        Opt("turns", choices=(1, 2), help="2: a prompt with a second turn (--prompts mt-bench) runs it next in the same "
                                          "conversation, reusing the caches of turn one as `api` and `chat` do"),
    ))
    s.add_argument("--wire-dtype", choices=DTYPE_NAMES, default=None,
                   help="dtype of hidden states on the wire (default: the one the shard records: bfloat16 for "
                        "Gemma 3, float16 otherwise)")
    s.add_argument("--cloud-device", help="device of the cloud server child (serve --device), e.g. cuda; default cpu")
    add_options(s, SpecBenchOptions, (
        Opt("in_flight", help="comma-separated blocks in flight (1-3, or auto: the controller chooses) to run each "
                              "speculative strategy with, e.g. 1,2,3,auto; D > 1 rows are reported against their bound"),
        Opt("cloud_pass_ms", help="the fast-cloud scenario: every cloud pass lasts at least this long (serve "
                                  "--min-pass-ms); with a shard whose cloud holds a layer or two, a GPU cloud"),
        Opt("cloud_compile_rows", help="the cloud server runs blocks of this many rows and more through "
                                       "torch.compile (serve --compile-rows; it compiles for minutes first)"),
        Opt("pad_rows", help="comma-separated padding settings ROWS[+sSTEPS][+hHOLD_MS][+tTHINK_MS], e.g. 0,33,33+s64: "
                             "each speculative strategy also runs with steps and replies padded to multiples of ROWS "
                             "rows, replies to multiples of STEPS exchanges, and timing padded (T6, docs/privacy.md; "
                             "--pad-rows and friends of generate), as '<name>+pad<setting>'"),
        Opt("pad_prompt_rows", help="padded configurations also pad prompt messages to multiples of this many rows"),
    ))
    s.add_argument("--readme", help="also put the results table between the `bench spec` markers of this file (README.md)")
    s.set_defaults(func=cmd_bench_spec)
